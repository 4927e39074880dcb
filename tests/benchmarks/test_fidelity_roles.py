"""The offline study's chain as the live retrieval workflow asks: roles, lookup key, answer prefix (no model)."""

from __future__ import annotations

import pytest

from benchmarks import fidelity as fid
from benchmarks.workloads.retrieval import answer_prefix


def _chars(text: str, add_special_tokens: bool = False) -> dict:
    return {"input_ids": [ord(c) for c in text]}


@pytest.fixture
def restored_chain():
    agents, chain, docs = list(fid.AGENTS), list(fid.CHAIN), fid.LOOKUP_DOCS
    yield
    fid.AGENTS[:], fid.CHAIN[:], fid.LOOKUP_DOCS = agents, chain, docs


def test_lookup_roles_ask_for_a_key_every_document_states(restored_chain):
    fid.use_retrieval_roles(lookup=True)
    docs = fid._source_texts("retrieval")
    assert docs and all(f"The code of {fid.LOOKUP_KEY} is" in d[:600] for d in docs)
    assert len(docs) < fid.RETRIEVAL_DOCS  # some documents do not state it: the filter did something
    for agent in fid.AGENTS:
        _, suffix = fid.agent_token_parts(_chars, agent)
        assert "".join(map(chr, suffix)).endswith("<|im_start|>assistant\n" + answer_prefix(fid.LOOKUP_KEY))


def test_plain_retrieval_roles_keep_every_document_and_an_open_answer(restored_chain):
    fid.use_retrieval_roles()
    assert len(fid._source_texts("retrieval")) == fid.RETRIEVAL_DOCS
    _, suffix = fid.agent_token_parts(_chars, fid.AGENTS[0])
    assert "".join(map(chr, suffix)).endswith("<|im_start|>assistant\n")


def test_the_scored_answer_is_the_exact_contexts_greedy_answer_up_to_its_end_token():
    """``--score answer`` teacher-forces NonShared's own greedy answer: ANSWER_TOKENS tokens, or fewer when
    it ends; a served context is then scored at the positions that predict those tokens."""
    from benchmarks.common import KV, prefill, suffix_eval
    from tests.tiny_models import tiny_llama

    model = tiny_llama(eos_token_id=None)
    context = prefill(model, list(range(10, 30)))[0]
    suffix = [40, 41, 42]
    full = fid._answer(model, context, suffix)
    assert len(full) == fid.ANSWER_TOKENS  # no end token: the whole budget
    _, greedy = suffix_eval(model, [context], suffix, fid.ANSWER_TOKENS, 1)
    assert full == greedy[0].tolist()
    model.config.eos_token_id = full[2]
    assert fid._answer(model, context, suffix) == full[:full.index(full[2]) + 1]  # cut after its first end token
    # the exact context predicts every answer token at the scored positions
    logp, _ = suffix_eval(model, [KV(context.k, context.v)], suffix + full[:-1])
    assert logp[0, len(suffix) - 1:].argmax(-1).tolist() == full


def test_the_answer_takes_the_length_it_is_asked_for():
    """``--answer-tokens`` scores the longer answers the live GSM8K frontier generates."""
    from benchmarks.common import prefill
    from tests.tiny_models import tiny_llama

    model = tiny_llama(eos_token_id=None)
    context = prefill(model, list(range(10, 30)))[0]
    long = fid._answer(model, context, [40, 41, 42], 20)
    assert len(long) == 20
    assert long[:fid.ANSWER_TOKENS] == fid._answer(model, context, [40, 41, 42])


def test_an_answer_of_no_tokens_is_refused_at_launch(capsys):
    with pytest.raises(SystemExit) as exc:
        fid.main(["--score", "answer", "--answer-tokens", "0"])
    assert exc.value.code == 2
    assert "--answer-tokens must be at least 1" in capsys.readouterr().err
