"""Anchor pools saved to disk and loaded back: the same decisions and corrections, and a clear error for a file
that belongs to another model, format or rank."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from sglang_kvshare.correction import RopeSpec, SegmentCache, make_estimator, materialize
from sglang_kvshare.correction import pool_file
from sglang_kvshare.correction.pool_file import (PoolFileError, kv_layout, load_pools, model_identity, rank_path,
                                                 save_pools)

SPEC = RopeSpec.default(head_dim=8)
SECRET = bytes(range(16))
RANK = {"tp": [0, 1], "dp": [0, 1]}


class _Config:
    model_type, architectures, hidden_size, num_hidden_layers = "llama", ["LlamaForCausalLM"], 16, 3
    num_attention_heads, num_key_value_heads, head_dim, vocab_size = 4, 2, 8, 100


KV = kv_layout(3, (2, 8), (2, 8), torch.float32)  # the layout of ``_segment``'s K and V
IDENTITY = model_identity(_Config(), None, SPEC, KV)


def _segment(g: torch.Generator, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, length, 2, 8, generator=g), torch.randn(3, length, 2, 8, generator=g)


def _learned(g: torch.Generator, **cfg):
    """A kvcmas estimator with two slots: ``doc`` holds 3 contents on edges a->b and b->c, ``q`` holds 2."""
    est = make_estimator("kvcmas", SPEC, tau=1.0, rank=4, min_edge_anchors=2, **cfg)
    for slot, contents in (("doc", 3), ("q", 2)):
        for c in range(contents):
            k, v = _segment(g)
            for src, dst, pos in (("a", "b", 7), ("b", "c", 11)):
                tk, tv = _segment(g)
                est.observe((("ns", None, None), slot), SegmentCache(k, v, 3, src), SegmentCache(tk, tv, pos, dst),
                            content_key=f"{slot}{c}")
    return est


def test_round_trip_gives_the_same_pools_and_corrections(tmp_path, gen):
    est = _learned(gen)
    slot = (("ns", None, None), "doc")
    k, v = _segment(gen)
    est.estimate(slot, SegmentCache(k, v, 3, "a"), "b", 7)  # an activation to carry over
    path = tmp_path / "pools.pt"
    written = save_pools(path, est, secret=SECRET, identity=IDENTITY, rank=RANK)
    assert written["slots"] == 2 and written["anchors"] == 5 and written["bytes"] == path.stat().st_size
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds factors of prompts' KV

    fresh = make_estimator("kvcmas", SPEC, tau=1.0, rank=4, min_edge_anchors=2)
    secret, summary = load_pools(path, fresh, identity=IDENTITY, rank=RANK)
    assert secret == SECRET and summary["anchors"] == 5 and summary["dropped"] == 0 and summary["slots"] == 2
    assert [s for s, _ in fresh.pools()] == [s for s, _ in est.pools()]  # LRU order kept
    before = {str(s): [(a["edges"], a["activations"], a["content_key"]) for a in p] for s, p in est.describe().items()}
    after = {str(s): [(a["edges"], a["activations"], a["content_key"]) for a in p] for s, p in fresh.describe().items()}
    assert after == before and fresh.memory_bytes() == est.memory_bytes()
    for src, dst, pos in (("a", "b", 7), ("b", "c", 11)):
        r0, r1 = (e.estimate(slot, SegmentCache(k, v, 3, src), dst, pos) for e in (est, fresh))
        assert r1.accepted and r0.accepted and r1.entropy == pytest.approx(r0.entropy)
        for got, want in zip(materialize(k, v, 3, pos, r1.plan, SPEC), materialize(k, v, 3, pos, r0.plan, SPEC)):
            torch.testing.assert_close(got, want)


def test_loading_keeps_the_servers_bounds(tmp_path, gen):
    path = tmp_path / "pools.pt"
    save_pools(path, _learned(gen), secret=SECRET, identity=IDENTITY, rank=RANK)
    small = make_estimator("kvcmas", SPEC, tau=1.0, rank=4, min_edge_anchors=2, max_slots=1)
    _, summary = load_pools(path, small, identity=IDENTITY, rank=RANK)
    assert summary["slots"] == 1 and summary["anchors"] == 2 and summary["dropped"] == 3
    assert [s[1] for s, _ in small.pools()] == ["q"]  # the most recently used slot stays


def _forge_anchor(payload: dict, field: str, value) -> dict:
    """The payload with one field of the last pool's last anchor replaced."""
    payload["pools"][-1]["anchors"][-1][field] = value
    return payload


def _forge(payload: dict, factors: str, field: str, value) -> dict:
    """The payload with one field of the last anchor's ``factors`` (``base_k``, ``base_v``) replaced."""
    payload["pools"][-1]["anchors"][-1][factors][field] = value
    return payload


@pytest.mark.parametrize("change, match", [
    (lambda p: {**p, "version": 99}, "format 99"),
    (lambda p: {**p, "model": {**p["model"], "weights": "other"}}, "another model .weights differs"),
    (lambda p: {**p, "model": {**p["model"], "architecture": "x"}}, "architecture differs"),
    (lambda p: {**p, "model": {**p["model"], "kv": kv_layout(3, (2, 16), (2, 16), torch.float32)}}, "kv differs"),
    (lambda p: {**p, "model": "forged"}, "kv differs: None there"),
    (lambda p: {**p, "rank": {"tp": [1, 2], "dp": [0, 1]}}, "belongs to rank"),
    (lambda p: {**p, "mode": "kvcomm"}, "holds 'kvcomm' anchors"),
    (lambda p: {"format": "something else"}, "not a kvshare pool file"),
    (lambda p: {**p, "pools": [{"slot": "x", "anchors": [{"content_key": "c"}]}]}, "damaged"),
    # forged tensors under the right identity: every shape, dtype and type is checked before anything loads
    (lambda p: _forge(p, "base_k", "head_shape", [4, 4]), "head shape \\[4, 4\\]; this server's KV has \\[2, 8\\]"),
    (lambda p: _forge(p, "base_k", "b", torch.zeros(3, 4, 8)), "shape \\[3, 4, 8\\] where \\[3, 4, 16\\]"),
    (lambda p: _forge(p, "base_v", "a", torch.zeros(2, 12, 4)), "shape \\[2, 12, 4\\] where \\[3, 12, \\*\\]"),
    (lambda p: _forge(p, "base_v", "a", torch.zeros(3, 11, 4)), "where \\[3, 12, \\*\\]"),  # another length
    (lambda p: _forge(p, "base_k", "a", torch.zeros(3, 12, 4, dtype=torch.float64)), "tensor of torch.float64"),
    (lambda p: _forge(p, "base_k", "a", torch.full((3, 12, 4), float("nan"))), "inf or NaN"),
    (lambda p: _forge(p, "base_k", "a", [[0.0]]), "list where a dense tensor"),
    (lambda p: _forge(p, "base_k", "full", torch.zeros(3, 12, 16)), "both a full matrix and low-rank"),
    (lambda p: _forge(p, "base_k", "head_shape", [True, 8]), "head shape"),
    (lambda p: _forge_anchor(p, "activations", True), "activations True"),
    (lambda p: _forge_anchor(p, "activations", -1), "activations -1"),
    (lambda p: _forge_anchor(p, "content_key", ["c"]), "a key of type list"),
    (lambda p: _forge_anchor(p, "base_v_gram", torch.zeros(12)), "tensor of torch.float32"),
    (lambda p: _forge_anchor(p, "deltas", [{"edge": {"a": 1}, "k": None, "v": None}]), "a key of type dict"),
    (lambda p: {**p, "pools": [{**p["pools"][0], "slot": ["ns", "doc"]}]}, "a key of type list"),
    (lambda p: {**p, "pools": {"x": 1}}, "pools is a dict"),
    (lambda p: {**p, "secret": torch.zeros(8, dtype=torch.uint8)}, "shape \\[8\\] where \\[16\\]"),
])
def test_a_file_that_does_not_match_is_refused_and_nothing_is_loaded(tmp_path, gen, change, match):
    path = tmp_path / "pools.pt"
    save_pools(path, _learned(gen), secret=SECRET, identity=IDENTITY, rank=RANK)
    torch.save(change(torch.load(path, weights_only=True)), path)
    fresh = make_estimator("kvcmas", SPEC, tau=1.0, rank=4, min_edge_anchors=2)
    with pytest.raises(PoolFileError, match=match):
        load_pools(path, fresh, identity=IDENTITY, rank=RANK)
    assert fresh.pools() == []


def test_unreadable_and_code_carrying_files_are_refused(tmp_path):
    fresh = make_estimator("kvcmas", SPEC)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(PoolFileError, match="cannot read"):
        load_pools(garbage, fresh, identity=IDENTITY, rank=RANK)
    code = tmp_path / "code.pt"
    torch.save({"format": pool_file.FORMAT, "object": Path("x")}, code)  # an arbitrary object: not data
    with pytest.raises(PoolFileError, match="cannot read"):
        load_pools(code, fresh, identity=IDENTITY, rank=RANK)


def test_identity_names_the_weights_and_rank_paths(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    a = model_identity(_Config(), str(tmp_path), SPEC, KV)
    (tmp_path / "model.safetensors").write_bytes(b"\1" + b"\0" * 99)  # a fine-tune: same config, other weights
    b = model_identity(_Config(), str(tmp_path), SPEC, KV)
    assert a["architecture"] == b["architecture"] and a["weights"] != b["weights"]
    # hub ids whose weights are not found: the whole id names the model, its organisation included
    assert model_identity(_Config(), "a/Llama-3.2-1B-Instruct", SPEC, KV)["weights"] != \
        model_identity(_Config(), "b/Llama-3.2-1B-Instruct", SPEC, KV)["weights"]
    other = _Config()
    other.num_hidden_layers = 4
    assert model_identity(other, None, SPEC, KV)["architecture"] != IDENTITY["architecture"]
    for layout in (kv_layout(3, (2, 16), (2, 16), torch.float32), kv_layout(3, (1, 8), (1, 8), torch.float32),
                   kv_layout(2, (2, 8), (2, 8), torch.float32), kv_layout(3, (2, 8), (2, 8), torch.bfloat16)):
        assert model_identity(_Config(), None, SPEC, layout)["kv"] != IDENTITY["kv"]
    assert rank_path("p.pt") == rank_path("p.pt", 0, 1, 0, 1) and str(rank_path("p.pt")) == "p.pt"
    assert str(rank_path("p.pt", tp_rank=1, tp_size=2)) == "p.pt.dp0.tp1"
    assert str(rank_path("p.pt", dp_rank=1, dp_size=2)) == "p.pt.dp1.tp0"
