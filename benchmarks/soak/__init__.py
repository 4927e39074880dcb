"""Soak and fault harness: is a kvshare server safe to leave running in front of clients?

``python -m benchmarks.soak`` starts its own kvshare server on 127.0.0.1 (``kvcmas``, ``--kvshare-tau 1`` and
``--kvshare-edge-anchors 2``, so that corrections really happen; ``--max-total-tokens 3072``, so that the tree
evicts and SGLang retracts; ``--kvshare-auto true``, ``--enable-metrics``), runs N client threads for M minutes
against it, stops by itself and writes a JSON verdict.

The clients mix (``TRAFFIC``) the kinds of ``generate`` (team rounds, plain repeats of annotated prompts, leak and
salt probes, malformed and fuzzed annotations from ``faults``, slot floods, early closes, reused ``rid``s),
``chat`` (chained agents of four tenants, automatic, explicit and opted out, streamed or not; hostile chats; scope
probes; bursts that over-commit the KV pool so that SGLang retracts) and ``admin`` (resets, config writes, mode
switches, calls without the key; reset probes).

Checks (``verdicts`` in the JSON, ``checks``): the server stayed up and its log holds no traceback or leak message;
no 5xx and no request lost; every malformed annotation got a 4xx and every valid one a 200; the allocator is back
where it started once idle and flushed; kvshare memory within its limits; zero aligned or corrected tokens across
salts, users and workflows, and no report names another scope's agent; hostile chats answered like stock or refused
with a message naming the fix; no estimate hit after a reset or a config change; ``/metrics`` serving
``sglang_kvshare_*``; and every plain request served from exact KV only, structurally
(``counters["plain_tokens_from_estimates"] == 0``) and by output: a sample is replayed one at a time on a fresh
server in mode ``off`` (or the one ``--reference-url`` names) and must give the same greedy tokens (divergences at a
near-tie listed apart). A check the server cannot answer yet is ``"not checked"`` and does not fail the run.

Every request has a timeout, the run has a deadline, and nothing leaves loopback.
"""

from benchmarks.soak.checks import check_bounds
from benchmarks.soak.client import TRAFFIC, Endpoint, Outcome, Recorder, generate_body
from benchmarks.soak.run import compare, main, soak_launch_args

__all__ = ["Endpoint", "Outcome", "Recorder", "TRAFFIC", "check_bounds", "compare", "generate_body", "main",
           "soak_launch_args"]
