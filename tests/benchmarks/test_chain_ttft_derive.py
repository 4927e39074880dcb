"""The pure part of ``benchmarks.chain_ttft``: medians, floors and ratios from recorded repeats."""

from __future__ import annotations

import pytest

from benchmarks.chain_ttft import AGENTS, arm_launch, derive
from sglang_kvshare.server.launcher import parse_kvshare


def _rep(ttft: float, floor: float, reused: int, first: float = 2.0, assembly: float = 0.01) -> dict:
    rows = {}
    for i, agent in enumerate(AGENTS):
        rows[agent] = {"ttft_s": first if i == 0 else ttft, "floor_s": floor, "shared_tokens_reused": 0 if i == 0
                       else reused, "assembly_s": 0.0 if i == 0 else assembly, "prefill_tokens": 1}
    return rows


def test_derive_ratios_against_floor_and_off():
    results = {"arms": {
        "off": {"100": {"repeats": [_rep(2.0, 0.5, 0), _rep(2.2, 0.5, 0), _rep(1.8, 0.5, 0)]}},
        "fullshared": {"100": {"repeats": [_rep(0.6, 0.5, 100), _rep(0.55, 0.5, 100), _rep(0.65, 0.5, 100)]}},
    }}
    derive(results, [100])
    cell = results["arms"]["fullshared"]["100"]
    assert cell["reuse_ratio"] == 1.0
    assert cell["reuse_over_floor"]["median"] == 1.2
    assert abs(cell["speedup_vs_off_agents_2_4"]["median"] - 2.0 / 0.6) < 1e-9
    assert cell["speedup_vs_off_agents_2_4"]["n"] == 3
    # assembly against off's dense prefill of the same content (TTFT minus its floor)
    assert abs(cell["assembly_over_dense_prefill"]["median"] - 0.01 / 1.5) < 1e-9
    assert results["arms"]["off"]["100"]["agent1_vs_off"]["median"] == 1.0


def test_an_arm_names_its_mode_and_extra_flags():
    assert arm_launch("kvcmas", 0.3) == ("kvcmas", ["--kvshare-tau", "0.3"])
    assert arm_launch("fullshared@recompute-ratio=0", 0.3) == (
        "fullshared", ["--kvshare-tau", "0.3", "--kvshare-recompute-ratio", "0.0"])
    mode, extra = arm_launch("kvcmas@learn-yield-s=0,learn-cpu-share=1,edge-anchors=4,recompute-ratio=0.3", 0.3)
    config, _ = parse_kvshare(["--kvshare-mode", mode, *extra])  # the learner's settings travel in a config file
    assert (config.learn_yield_s, config.learn_cpu_share, config.edge_anchors, config.recompute_ratio) == (0, 1, 4, 0.3)
    assert "--kvshare-config" in extra and "--kvshare-edge-anchors" in extra
    with pytest.raises(ValueError, match="not a kvshare setting"):
        arm_launch("kvcmas@learn-yeld-s=0", 0.3)
    with pytest.raises(ValueError, match="name=value"):
        arm_launch("kvcmas@learn-yield-s", 0.3)
