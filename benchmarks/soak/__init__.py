"""Soak and fault harness: is a kvshare server safe to leave running in front of clients?

``python -m benchmarks.soak`` starts its own kvshare server on 127.0.0.1 (mode
``kvcmas`` with ``--kvshare-tau 1`` and ``--kvshare-edge-anchors 2`` by default, so that corrections really happen,
a small KV pool, ``--max-total-tokens 3072``, so that the tree evicts and SGLang
retracts, ``--kvshare-auto true`` and ``--enable-metrics``), runs N client threads
for M minutes against it, stops by itself and writes a JSON verdict.

The clients mix (``TRAFFIC``): valid multi-agent team rounds (four agents with their
own system prompts read the same GSM8K text, chained); plain requests (no
annotation) whose prompt equals an annotated one; probes built to catch a leak
(agent B assembled from agent A's copy, then a plain request with B's exact prompt)
and reuse across ``cache_salt`` (content seen only under salt A, asked under salt B);
malformed and adversarial annotations (a fixed catalogue and fuzzed JSON, see
``faults``); requests with thousands of distinct slot names; streams closed
early; client-chosen ``rid`` reused (after completion, after an abort, twice at
once); admin calls (reset, config, a switch to ``off`` and back, calls without
the key). On ``/v1/chat/completions``: chained agents of four tenants (two OpenAI
``user``s, two ``cache_salt``s, each with its own system prompts) reading the same
documents, automatic and explicit (``kvshare`` field), streamed and not, 40-message
conversations, opt-outs (``"kvshare": false``); hostile chats (the chat layer's
sentinel text, list-valued content, tool calls, ``n > 1``, logprobs, explicit fields
to refuse); scope probes (a document only tenant A sent, then read by tenant B; also
``/generate`` annotations of two workflows); estimate probes (an assembled prompt
repeated, ``POST /kvshare/reset`` or ``/kvshare/config``, repeated again); and bursts
of concurrent decodes of staggered lengths that over-commit the KV pool, so that
SGLang retracts requests (counted from its log, not required).

Checks (``verdicts`` in the JSON): the server stayed up and its log holds no
traceback or leak message; no 5xx and no request lost (chat streams included);
every malformed annotation got a 4xx and every valid one a 200; the allocator is
back where it started once idle and flushed (``kv_pool_tokens``); kvshare memory
within its limits (``stats["limits"]`` vs ``stats["usage"]``, the read workspace
and the chat answer memory included); zero aligned or corrected tokens across
salts, users and workflows; no report names another scope's agent; hostile chats
answered like stock or refused with a message naming the fix; chat reports where
they belong; no estimate hit after a reset or a config change; ``/metrics``
serving ``sglang_kvshare_*``; and every plain request served from exact KV only,
structurally (``counters["plain_tokens_from_estimates"] == 0``) and by output: a
sample of plain requests is replayed one at a time on a fresh server in mode
``off`` (or on the running one ``--reference-url`` names, flushed before each
replay) and must give the same greedy tokens (divergences whose first differing
token was a near-tie in the ``off`` run are listed apart). A check the server
cannot answer yet (a missing field) is reported as ``"not checked"`` and does not
fail the run.

Every request has a timeout, the run has a deadline, and nothing leaves loopback.

Modules: ``client`` (HTTP calls and tallies), ``traffic`` (the client threads), ``generate`` / ``chat`` /
``admin`` (the traffic kinds), ``faults`` (the fault catalogues), ``checks`` (monitor and verdicts), ``run``.
"""

from benchmarks.soak.checks import check_bounds
from benchmarks.soak.client import Endpoint, Outcome, Recorder, generate_body
from benchmarks.soak.run import compare, main, soak_launch_args
from benchmarks.soak.traffic import TRAFFIC

__all__ = ["Endpoint", "Outcome", "Recorder", "TRAFFIC", "check_bounds", "compare", "generate_body", "main",
           "soak_launch_args"]
