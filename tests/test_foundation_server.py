"""The foundation on the real server: kvshare backend live, radix hits, parity with stock SGLang."""

from __future__ import annotations

import pytest

from tests.servers import OFF

pytestmark = pytest.mark.server

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the square of a number.",
    "<|im_start|>user\nWhat is 17 times 3?<|im_end|>\n<|im_start|>assistant\n",
    "List three colors of the rainbow:",
]

LONG_PREFIX = (
    "You are a careful assistant. Read the passage and answer briefly.\n"
    + " ".join(f"Sentence {i}: the river flows past the old mill and the village square." for i in range(20))
)


@pytest.fixture(scope="module")
def off_outputs(server_pool):
    server = server_pool("off", kvshare_args=OFF)
    info = server.server_info()
    log = server.log_text()
    outputs = [server.generate(p, max_new_tokens=24)["text"] for p in PROMPTS]
    first = server.generate(LONG_PREFIX + "\nQuestion: what flows?", max_new_tokens=4)
    second = server.generate(LONG_PREFIX + "\nQuestion: where is the mill?", max_new_tokens=4)
    return {"info": info, "log": log, "outputs": outputs, "first": first, "second": second}


def test_kvshare_backend_is_the_live_cache(off_outputs):
    assert off_outputs["info"]["radix_cache_backend"] == "kvshare"
    assert "impl=KVShareRadixCache" in off_outputs["log"]


def test_second_request_with_shared_prefix_hits_the_radix_cache(off_outputs):
    first, second = off_outputs["first"], off_outputs["second"]
    assert first["meta_info"]["cached_tokens"] == 0
    # The whole long prefix (well over 100 tokens) comes from the tree.
    assert second["meta_info"]["cached_tokens"] > 100
    assert second["meta_info"]["cached_tokens"] < second["meta_info"]["prompt_tokens"]


def test_mode_off_greedy_outputs_equal_stock_sglang(off_outputs, server_pool):
    stock = server_pool("stock", stock=True)
    info = stock.server_info()
    assert info["radix_cache_backend"] in (None, "")
    stock_outputs = [stock.generate(p, max_new_tokens=24)["text"] for p in PROMPTS]
    assert stock_outputs == off_outputs["outputs"]


def test_a_plain_sglang_server_beside_the_plugin_behaves_as_stock(off_outputs, server_pool, model_path):
    """The package is installed here, so SGLang loads its plugin in the stock server too: it must change nothing."""
    import json

    import requests
    from transformers import AutoTokenizer

    stock = server_pool("stock", stock=True)
    assert "sglang-kvshare: installed" not in stock.log_text()
    assert "sglang-kvshare: installed" in off_outputs["log"]  # the kvshare server did install its hooks
    for path in ("/kvshare/stats", "/kvshare/chat", "/kvshare/pools"):
        assert requests.get(stock.url + path, timeout=60).status_code == 404, path
    # A malformed annotation means nothing to stock SGLang (a kvshare server answers 400).
    ids = AutoTokenizer.from_pretrained(model_path)("Hello there", add_special_tokens=False).input_ids
    bad = {"kvshare": json.dumps({"agent": "a", "segments": [{"kind": "shared", "start": 0, "end": 99}]})}
    assert "kvshare" not in stock.generate(input_ids=ids, custom_params=bad, max_new_tokens=2)["meta_info"]
    # A chat request with the kvshare field is served as stock serves it: no report added.
    chat = requests.post(stock.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "kvshare": {"agent": "a", "shared": [{"message": 1, "slot": "q"}]}})
    assert chat.status_code == 200 and "kvshare" not in chat.json()
