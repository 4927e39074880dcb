"""Staged prefill: SGLang's chunked prefill, cut where reuse can resume.

Why hooks on the prefill adder: SGLang 0.5.23 calls ``match_prefix`` once,
when a request is admitted; a chunked request's next chunk starts from its
own row (``init_next_round_input`` gets no tree cache). To prefill an unseen
stretch densely and then *resume* reuse for the segments behind it within the
same request, the cache must (1) end the current chunk where reuse can resume
and (2) assemble the next segments between two chunks. Both fit SGLang's own
chunked-prefill machinery, so nothing else in the scheduler changes:

* AROUND ``PrefillAdder._select_prefill_admission`` (a new request): when the
  cache has a stage end inside the request's extend, the admission becomes a
  chunk that ends there. SGLang tracks one chunked request at a time, so a
  request that needs staging while another is mid-chunk, or was made a chunk
  earlier in the same round, waits for the next round
  (``AddReqResult.CONTINUE``: the other waiting requests still go).
* AROUND ``PrefillAdder.add_chunked_req`` (the next chunk of a request): first
  ``cache.kvshare_resume(req)`` assembles what can be reused from the
  request's prefix on (the previous chunk is in the tree by then: the
  scheduler's ``stash_chunked_request`` checkpointed it), then the chunk is
  capped at the next stage end through SGLang's own ``chunked_req_limit``.

Cost of a stage: one more scheduling round and forward pass for the request
(measured in ``benchmarks.chain_ttft``; see docs/research/STAGED_PREFILL.md). A
recomputed head needs no stage where the sparse extend runs
(``server/sparse_extend.py``); a segment that cannot be reused still does.

Their targets are named in ``server/sglang_targets.py``; ``server/plugin.py`` installs them
when SGLang builds the kvshare cache (inert for requests the cache gives no stage end).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

def around_select_prefill_admission(original, adder, req, *args, **kwargs):
    """End a new request's first chunk where the cache's first dense stretch ends."""
    admission = original(adder, req, *args, **kwargs)
    if not hasattr(admission, "extend_len"):
        return admission
    stage_end = getattr(adder.tree_cache, "kvshare_stage_end", None)
    end = None if stage_end is None else stage_end(req, admission.prefix_len)
    staged = end is not None and admission.prefix_len + admission.extend_len > end
    if not staged and not admission.is_chunked:
        return admission
    from sglang.srt.managers.schedule_policy import AddReqResult

    # One chunked request at a time: SGLang records it in ``adder.new_chunked_req``
    # (this round) and ``scheduler.chunked_req`` (``has_chunked_req``: an earlier
    # round). SGLang's own chunks fill the round's whole token budget, so it never
    # admits a second one; a stage is short and leaves budget, so a second chunk
    # in the same round (staged, or one SGLang cuts itself) would overwrite the
    # first one's record, and the first would decode from half a prompt.
    pending = getattr(adder, "new_chunked_req", None)
    if (pending is not None and pending is not req) or (kwargs.get("has_chunked_req") and not admission.is_chunked):
        return AddReqResult.CONTINUE  # waits a round; the other waiting requests still go
    if not staged:
        return admission
    return type(admission)(admission.prefix_len, end - admission.prefix_len, 0, True, admission.replay_len)


def around_add_chunked_req(original, adder, req):
    """Between two chunks: resume reuse, then cap the chunk at the next stage end."""
    cache = adder.tree_cache
    if hasattr(cache, "kvshare_resume"):
        cache.kvshare_resume(req)  # never raises
        end = cache.kvshare_stage_end(req, req.prefix_len)
        if end is not None:
            limit = end - req.prefix_len
            adder.chunked_req_limit = limit if adder.chunked_req_limit is None else min(adder.chunked_req_limit,
                                                                                         limit)
    return original(adder, req)
