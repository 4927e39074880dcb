"""The staged-prefill admission hook keeps SGLang's rule: one chunked request at a time.

Why this test: a stage is a short chunk that leaves budget in the round, so a
second request admitted in the same round could also become a chunk. SGLang
records one (``adder.new_chunked_req``); the first would then be prefilled only
up to its stage end and decode from half a prompt. Seen live: with
``--kvshare-recompute-head 32`` and 4 concurrent clients, 0.44 of the retrieval
answers agreed with ``off``.
"""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission

from sglang_kvshare.server.staged_prefill import around_select_prefill_admission


class StageAt:
    """A tree cache that wants every request's current stage to end at ``end``."""

    def __init__(self, end):
        self.end = end

    def kvshare_stage_end(self, req, prefix_len):
        return self.end if self.end is not None and prefix_len < self.end else None


def admit(adder, req, extend_len=100, is_chunked=False, has_chunked_req=False):
    def original(_adder, _req, **_kw):
        return _PrefillAdmission(10, extend_len, 16, is_chunked, 0)

    return around_select_prefill_admission(original, adder, req, total_tokens=0, host_hit_length=0,
                                           swa_host_hit_length=0, truncation_align_size=None,
                                           has_chunked_req=has_chunked_req)


def test_a_stage_becomes_a_chunk_that_ends_at_the_stage_end():
    adder = SimpleNamespace(tree_cache=StageAt(42), new_chunked_req=None)
    got = admit(adder, object())
    assert got.is_chunked and got.prefix_len + got.extend_len == 42 and got.max_new_tokens == 0


def test_a_second_stage_in_the_same_round_waits():
    first = object()
    adder = SimpleNamespace(tree_cache=StageAt(42), new_chunked_req=first)
    assert admit(adder, object()) is AddReqResult.CONTINUE


def test_a_chunk_sglang_cuts_itself_waits_behind_a_stage_of_this_round():
    adder = SimpleNamespace(tree_cache=StageAt(None), new_chunked_req=object())
    assert admit(adder, object(), is_chunked=True) is AddReqResult.CONTINUE


def test_a_stage_waits_while_an_earlier_round_holds_the_chunked_slot():
    adder = SimpleNamespace(tree_cache=StageAt(42), new_chunked_req=None)
    assert admit(adder, object(), has_chunked_req=True) is AddReqResult.CONTINUE


def test_requests_that_need_no_stage_are_untouched():
    adder = SimpleNamespace(tree_cache=StageAt(None), new_chunked_req=object())
    got = admit(adder, object())
    assert not got.is_chunked and got.extend_len == 100 and got.max_new_tokens == 16
