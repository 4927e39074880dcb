"""One view of several data-parallel ranks: their stats, pools and write replies merged.

Why: with ``--dp-size N`` every rank runs its own cache (its own copies, pools
and counters), but an operator asks the server one question ("how much is
reused", "how much do the pools hold", "did the change apply"). So counts and
sizes add up, ratios are recomputed from the summed counts (never averaged),
settings are shown once when every rank agrees, and each rank's own figures
stay under ``ranks``. Plain dicts in, plain dicts out: the HTTP process calls
these on what the ranks answered; nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any, Optional

from sglang_kvshare.admin.ops import Reply

# Per-rank figures worth seeing side by side (each rank's own reuse shows a skewed placement).
RANK_FIELDS = ("shared_tokens_seen", "reuse_ratio", "anchor_bytes", "pending_observations", "kv_pool_tokens",
               "unsupported_reason")
_SETTINGS = ("mode", "config")  # equal on every rank after every write; shown once


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _merge(values: list) -> Any:
    """Numbers add up, dicts merge key by key, anything else is kept when every rank agrees
    (else the list of per-rank values)."""
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge([v[k] for v in values if k in v]) for k in keys}
    if all(_is_number(v) for v in values):
        return sum(values)
    return values[0] if all(v == values[0] for v in values) else list(values)


def _ratios(slot: dict) -> dict:
    """A merged slot's ratios, recomputed from its summed counters."""
    seen = slot.get("shared_tokens_seen", 0)
    reused = slot.get("resolved_alignment", 0) + slot.get("resolved_correction", 0)
    resolved = reused + slot.get("resolved_hit", 0)
    slot["reuse_ratio"] = reused / seen if seen else 0.0
    slot["resolved_ratio"] = resolved / seen if seen else 0.0
    return slot


def _mean_entropy(parts: list[dict]) -> Optional[float]:
    """The slot's mean gate entropy over every rank's decisions (weighted by their number)."""
    weighted = [(p["mean_gate_entropy"], p.get("gate_decisions", 1)) for p in parts
                if p.get("mean_gate_entropy") is not None]
    decisions = sum(n for _, n in weighted)
    return sum(m * n for m, n in weighted) / decisions if decisions else None


def merge_stats(snaps: list[dict]) -> dict:
    """``{"config", "stats", "ranks", "dp_size"}`` from the ranks' snapshots (``ops.snapshot`` plus
    ``dp_rank``). One snapshot comes back as it is, with its rank listed. Ranks that did not answer in time
    (``timed_out_ranks`` on the snapshots, from ``AdminChannel.read``) are named in the stats."""
    snaps = sorted(snaps, key=lambda s: s.get("dp_rank", 0))
    stats = [s["stats"] for s in snaps]
    timed_out = sorted({int(r) for s in snaps for r in s.get("timed_out_ranks", ())})
    if timed_out:
        for part in stats:
            part["timed_out_ranks"] = timed_out
    ranks = [{"dp_rank": s.get("dp_rank", 0), **{k: s["stats"][k] for k in RANK_FIELDS if k in s["stats"]},
              **({"tp_ranks": s["tp_ranks"]} if s.get("tp_ranks") else {})}
             for s in snaps]
    if len(snaps) == 1:
        return {"config": snaps[0]["config"], "stats": stats[0], "ranks": ranks, "dp_size": 1}
    merged = _merge([{k: v for k, v in s.items() if k not in _SETTINGS + ("slots",)} for s in stats])
    slots: dict[str, dict] = {}
    for name in dict.fromkeys(n for s in stats for n in s.get("slots", {})):
        parts = [s["slots"][name] for s in stats if name in s.get("slots", {})]
        slot = _ratios(_merge([{k: v for k, v in p.items() if k != "mean_gate_entropy"} for p in parts]))
        slot["mean_gate_entropy"] = _mean_entropy(parts)
        slots[name] = slot
    seen = sum(s["shared_tokens_seen"] for s in slots.values())
    reused = sum(s["resolved_alignment"] + s["resolved_correction"] for s in slots.values())
    merged.update(slots=slots, shared_tokens_seen=seen, reuse_ratio=reused / seen if seen else 0.0)
    configs = [s["config"] for s in snaps]
    merged["mode"] = stats[0].get("mode")
    merged["config"] = configs[0]
    if any(c != configs[0] for c in configs):
        # A write that reached some ranks only (one failed): say so rather than show rank 0's as everyone's.
        merged["config_differs_on_ranks"] = [r["dp_rank"] for r, c in zip(ranks, configs) if c != configs[0]]
    return {"config": configs[0], "stats": merged, "ranks": ranks, "dp_size": len(snaps)}


def merge_pools(replies: list[dict]) -> dict[str, list[dict]]:
    """Every rank's anchors per slot, each tagged with its ``dp_rank`` (a slot one rank never saw is
    simply absent there)."""
    pools: dict[str, list[dict]] = {}
    for reply in sorted(replies, key=lambda r: r.get("dp_rank", 0)):
        for slot, anchors in (reply.get("result", {}).get("pools") or {}).items():
            pools.setdefault(slot, []).extend({**a, "dp_rank": reply.get("dp_rank", 0)} for a in anchors)
    return pools


def merge_replies(op: str, replies: list[dict], dp_size: int) -> Reply:
    """One reply for an op every rank ran (``replies``: ``Reply`` dicts with ``dp_rank``).

    A rank that did not answer, or answered a failure, makes the whole call fail with the ranks named;
    for a one-slot read or reset a 404 on some ranks only is no failure (that rank never saw the slot).
    """
    by_rank = {int(r.get("dp_rank", 0)): r for r in replies}
    missing = sorted(set(range(dp_size)) - set(by_rank))
    per_rank = [{"dp_rank": rank, "status": r["status"], "message": r.get("message", "")}
                for rank, r in sorted(by_rank.items())]
    if missing:
        return Reply(502, f"kvshare admin op {op!r}: data-parallel rank(s) {missing} did not answer in time; "
                          f"the others ({sorted(by_rank)}) may have applied it",
                     {"ranks": per_rank, "timed_out_ranks": missing})
    unknown_here = [r for r in by_rank.values() if r["status"] == 404]
    failed = [r for r in by_rank.values() if r["status"] >= 400 and r["status"] != 404]
    if len(unknown_here) == len(by_rank):
        return Reply(404, unknown_here[0].get("message", "unknown slot"), {"ranks": per_rank})
    if failed:
        status = failed[0]["status"]
        applied = sorted(rank for rank, r in by_rank.items() if r["status"] < 400)
        names = sorted(int(r.get("dp_rank", 0)) for r in failed)
        note = f"; it applied on rank(s) {applied}" if applied and op != "pools" else ""
        return Reply(status, f"kvshare admin op {op!r} failed on data-parallel rank(s) {names}: "
                             f"{failed[0].get('message', '')}{note}", {"ranks": per_rank})
    ok = [r for r in by_rank.values() if r["status"] < 400]
    result = dict(ok[0].get("result") or {})
    if "pools" in result:
        result["pools"] = merge_pools(ok)
    return Reply(200, ok[0].get("message", ""), {**result, "ranks": per_rank})
