"""Requests through SGLang's router, without a server: the annotation and workflow put back in place."""

from __future__ import annotations

import json
from types import SimpleNamespace

from sglang_kvshare.protocol import Annotation, Segment
from sglang_kvshare.routing import ROUTING_HEADER, adopt_generate, chat_field, routed_fields, routing_key

ANN = Annotation(agent="b", segments=(Segment(kind="private", start=0, end=2), Segment(kind="shared", start=2, end=4,
                                                                                          slot="doc")))


def _request(**headers):
    return SimpleNamespace(headers=headers)


def _obj(custom_params=None, custom_labels=None):
    return SimpleNamespace(sampling_params={"max_new_tokens": 1, **({"custom_params": custom_params}
                                                                   if custom_params else {})},
                           custom_labels=custom_labels)


def test_an_annotation_the_router_kept_in_the_labels_moves_back_and_names_its_workflow():
    fields = routed_fields(ANN.model_copy(update={"workflow": "crew-1"}))
    obj = _obj(custom_labels=dict(fields["custom_labels"]))  # what arrives: custom_params dropped on the way
    adopt_generate(obj, _request(**{ROUTING_HEADER: "crew-1"}))
    assert obj.custom_labels is None  # never left for SGLang's Prometheus labels
    ann = json.loads(obj.sampling_params["custom_params"]["kvshare"])
    assert ann["workflow"] == "crew-1" and ann["agent"] == "b"


def test_the_routing_key_names_the_workflow_of_a_request_that_names_none_and_only_then():
    obj = _obj(custom_params=ANN.to_custom_params(), custom_labels={"team": "x"})
    adopt_generate(obj, _request(**{ROUTING_HEADER: "k-7"}))
    assert json.loads(obj.sampling_params["custom_params"]["kvshare"])["workflow"] == "k-7"
    assert obj.custom_labels == {"team": "x"}  # other labels untouched
    named = _obj(custom_params=ANN.model_copy(update={"workflow": "own"}).to_custom_params())
    adopt_generate(named, _request(**{ROUTING_HEADER: "k-7"}))
    assert json.loads(named.sampling_params["custom_params"]["kvshare"])["workflow"] == "own"
    plain = _obj()
    adopt_generate(plain, _request(**{ROUTING_HEADER: "k-7"}))
    assert "custom_params" not in plain.sampling_params  # an unannotated request stays unannotated


def test_bad_carriers_are_left_for_the_validation_to_refuse():
    obj = _obj(custom_labels={"kvshare": "{not json"})
    adopt_generate(obj, _request(**{ROUTING_HEADER: "k"}))
    assert obj.sampling_params["custom_params"]["kvshare"] == "{not json"  # the validation hook answers 400
    assert routing_key(_request(**{ROUTING_HEADER: "x" * 1000})) is None and routing_key(None) is None
    assert routed_fields(ANN) == {}  # no workflow, no router: nothing extra in the body


def test_a_chat_annotation_rides_in_metadata():
    assert chat_field({"kvshare": {"agent": "a"}}) == {"agent": "a"}
    assert chat_field({"metadata": {"kvshare": json.dumps({"agent": "a"})}}) == {"agent": "a"}
    assert chat_field({"metadata": {"kvshare": "false"}}) is False  # the opt-out survives too
    assert chat_field({"metadata": {"other": "1"}}) is None and chat_field([1]) is None
