"""``KVShareEndpoint``: SGLang's ``RuntimeEndpoint`` that sends kvshare annotations.

For a ``gen`` whose program carries ``shared``/``agent`` marks it builds the
prompt's ``input_ids`` segment by segment (``segments.request_from_marks``), puts
the annotation into ``sampling_params.custom_params`` and warms the agent's
leading private segment once (a ``max_new_tokens=0`` request, as SGLang's
frontend does with ``cache_prefix``), so the server can place shared segments
behind a prefix it holds. Everything else is ``RuntimeEndpoint``:

* a program without marks sends exactly the request ``RuntimeEndpoint`` sends
  (the same JSON body, text and all);
* a stock SGLang server, or a kvshare server in mode ``off``, accepts the
  annotation and ignores it, so the same program runs anywhere;
* ``select``, ``cache_prefix``, streaming programs (``stream=True``) and
  images are stock and unannotated.

Annotated requests are streamed internally to measure the client-side time to
first token; every ``gen``'s ``meta_info`` gets a ``"kvshare_client"`` entry:
``{"agent", "ttft_s", "latency_s", "annotated", "segments", "warmed"}``. The
server's own report, when it has one, stays in ``meta_info["kvshare"][0]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

import requests
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.chat_template import get_chat_template
from sglang.lang.global_config import global_config
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglSamplingParams
from sglang.utils import http_request

from sglang_kvshare.frontend.primitives import GenSpan, collect_marks, record_gen
from sglang_kvshare.frontend.segments import request_from_marks
from sglang_kvshare.protocol import Segment, generated_ids_for_text
from sglang_kvshare.routing import routed_fields, routing_headers
from sglang_kvshare.frontend.builder import BuiltRequest

logger = logging.getLogger(__name__)

MAX_REMEMBERED_OUTPUTS = 4096


class KVShareEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that turns ``shared``/``agent`` marks into kvshare annotations.

    ``tokenizer``: a Hugging Face tokenizer identical to the server's (default:
    loaded from the server's reported ``tokenizer_path``; pass one when the
    server's path is not readable here). ``chat_template_name``: as in
    ``RuntimeEndpoint``; when omitted and SGLang does not recognise the model
    path, a tokenizer whose template uses ``<|im_start|>`` selects ``chatml``.
    ``warm``: warm each agent's leading private segment once. ``measure_ttft``:
    stream annotated requests to time the first token. ``commit_outputs``: after
    an answer cut by ``max_tokens``, have the server compute its last token's KV
    so consumers reuse the whole answer (``_commit_output``). Thread-safe (one
    instance may serve ``run_batch`` threads).
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Optional[str] = None,
                 chat_template_name: Optional[str] = None, *, tokenizer: Any = None,
                 warm: bool = True, measure_ttft: bool = True, commit_outputs: bool = True,
                 timeout: float = 3600.0) -> None:
        super().__init__(base_url, api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        if tokenizer is None:
            from transformers import AutoTokenizer

            path = self.model_info.get("tokenizer_path") or self.model_info["model_path"]
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        if chat_template_name is None and self.chat_template.name == "default":
            template = getattr(tokenizer, "chat_template", None) or ""
            if "<|im_start|>" in template:
                self.chat_template = get_chat_template("chatml")
        self.warm = warm
        self.commit_outputs = commit_outputs
        self.measure_ttft = measure_ttft
        self.timeout = timeout
        self.prefix_ids = self._special_prefix()
        self._outputs: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._warmed: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._warm_lock = threading.Lock()
        self._session = requests.Session()

    # ------------------------------------------------------------ tokenization
    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added (special-token text still maps to its id)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _special_prefix(self) -> list[int]:
        with_special = list(self.tokenizer("x", add_special_tokens=True)["input_ids"])
        plain = self.tokenize("x")
        n = len(with_special) - len(plain)
        return with_special[:n] if n > 0 and with_special[n:n + len(plain)] == plain else []

    def build(self, s: StreamExecutor) -> Optional[BuiltRequest]:
        """The annotated request for ``s``'s current text, or None when it has no marks."""
        marks = collect_marks(s.variables, len(s.text_))
        if marks.empty:
            return None
        return request_from_marks(s.text_, marks, self.tokenize, prefix_ids=self.prefix_ids,
                                  lookup_output=self.lookup_output)

    # ------------------------------------------------------------ generated ids
    def lookup_output(self, text: str) -> Optional[tuple[int, ...]]:
        with self._lock:
            ids = self._outputs.get(text)
            if ids is not None:
                self._outputs.move_to_end(text)
            return ids

    def _remember_output(self, text: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._outputs[text] = ids
            self._outputs.move_to_end(text)
            while len(self._outputs) > MAX_REMEMBERED_OUTPUTS:
                self._outputs.popitem(last=False)

    # ------------------------------------------------------------ requests
    def _stock_body(self, s: StreamExecutor, sampling_params: SglSamplingParams) -> dict:
        # NOTE: byte-for-byte the body RuntimeEndpoint.generate sends.
        self._handle_dtype_to_regex(sampling_params)
        data = {
            "text": s.text_,
            "sampling_params": {
                "skip_special_tokens": global_config.skip_special_tokens_in_output,
                "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                **sampling_params.to_srt_kwargs(),
            },
        }
        for item in ["return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"]:
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        self._add_images(s, data)
        return data

    def _headers(self, workflow: Optional[str] = None) -> dict:
        """The key, and for a named workflow the header that keeps its requests on one server behind
        SGLang's router (the warm-up, the request and the commit must all meet its copies there)."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **routing_headers(workflow)}

    def _warm_prefix(self, built: BuiltRequest) -> Optional[tuple[str, str]]:
        ids = built.first_private_ids
        if not self.warm or not ids:
            return None
        workflow = built.annotation.workflow
        # Per workflow: behind a router, each workflow's server needs its own warm prefix.
        key = (built.annotation.agent, workflow,
               hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest())
        with self._warm_lock:
            if key not in self._warmed:
                res = self._session.post(self.base_url + "/generate", headers=self._headers(workflow),
                                         verify=self.verify, timeout=self.timeout,
                                         json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
                self._assert_success(res)
                self._warmed.add(key)
        return key

    def _commit_output(self, built: BuiltRequest, ids: Sequence[int]) -> None:
        """Give the server the KV of a producer's last generated token.

        A generation cut by ``max_tokens`` (no EOS, no stop string) ends with a
        token the server sampled but never ran through the model, so its KV does
        not exist, and a consumer's copy of the answer could reuse all but that
        token; everything after the gap would then be prefilled. One more request
        (the same prompt plus the answer as a shared segment of the output slot,
        ``max_new_tokens=0``) hits the tree for all but that token, computes it,
        and registers the complete answer. Best effort: a failure only costs reuse.
        """
        slot = built.annotation.output_slot
        if not slot or not self.commit_outputs:
            return
        start = len(built.input_ids)
        annotation = built.annotation.model_copy(update={
            "output_slot": None,
            "segments": (*built.annotation.segments, Segment(kind="shared", start=start, end=start + len(ids),
                                                             slot=slot))})
        try:
            res = self._session.post(self.base_url + "/generate", headers=self._headers(built.annotation.workflow),
                                     verify=self.verify, timeout=self.timeout,
                                     json={"input_ids": [*built.input_ids, *ids],
                                           "sampling_params": {"max_new_tokens": 0,
                                                               "custom_params": annotation.to_custom_params()},
                                           **routed_fields(annotation)})
            if not res.ok:
                logger.warning("sglang-kvshare: committing an output failed: HTTP %s %s",
                               res.status_code, res.text[:200])
        except requests.RequestException as exc:
            logger.warning("sglang-kvshare: committing an output failed: %s", exc)

    def _post(self, data: dict, workflow: Optional[str]) -> dict:
        res = self._session.post(self.base_url + "/generate", json=data, headers=self._headers(workflow),
                                 verify=self.verify, timeout=self.timeout)
        self._assert_success(res)
        return res.json()

    def _post_streaming(self, data: dict, workflow: Optional[str]) -> tuple[dict, Optional[float]]:
        t0 = time.perf_counter()
        ttft, last = None, None
        with self._session.post(self.base_url + "/generate", json={**data, "stream": True}, stream=True,
                                headers=self._headers(workflow), verify=self.verify, timeout=self.timeout) as res:
            self._assert_success(res)
            for line in res.iter_lines(decode_unicode=False):
                if not line or not line.startswith(b"data:"):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                last = json.loads(line[5:].strip())
                if ttft is None and last.get("output_ids"):
                    ttft = time.perf_counter() - t0
        if last is None:
            raise RuntimeError("the server's stream ended without a response")
        return last, ttft

    def generate(self, s: StreamExecutor, sampling_params: SglSamplingParams):
        data = self._stock_body(s, sampling_params)
        built = None if s.images_ else self.build(s)
        warm_key = None
        t0 = time.perf_counter()
        if built is None:
            res = http_request(self.base_url + "/generate", json=data, api_key=self.api_key, verify=self.verify)
            self._assert_success(res)
            obj, ttft = res.json(), None
        else:
            del data["text"]
            data["input_ids"] = built.input_ids
            sp = data["sampling_params"]
            sp["custom_params"] = {**(sp.get("custom_params") or {}), **built.annotation.to_custom_params()}
            data.update(routed_fields(built.annotation))
            warm_key = self._warm_prefix(built)
            t0 = time.perf_counter()
            if self.measure_ttft:
                obj, ttft = self._post_streaming(data, built.annotation.workflow)
            else:
                obj, ttft = self._post(data, built.annotation.workflow), None
        latency = time.perf_counter() - t0
        comp, meta = obj["text"], obj["meta_info"]
        ids = generated_ids_for_text(self.tokenizer, comp, obj.get("output_ids"))
        if ids is not None:
            record_gen(s.variables, GenSpan(len(s.text_), len(s.text_) + len(comp), ids))
            self._remember_output(comp, ids)
            if built is not None and len(ids) == len(obj.get("output_ids") or ()):
                self._commit_output(built, ids)
        report = (meta.get("kvshare") or [None])[0]
        if warm_key is not None and report and report.get("segments"):
            if report["segments"][0].get("resolved_by") == "dense":  # the server lost it: warm again next time
                with self._warm_lock:
                    self._warmed.discard(warm_key)
        meta["kvshare_client"] = {
            "agent": built.annotation.agent if built else None,
            "annotated": built is not None,
            "ttft_s": ttft,
            "latency_s": latency,
            "prompt_tokens": meta.get("prompt_tokens"),
            "segments": [seg.model_dump(exclude_none=True) for seg in built.annotation.segments] if built else None,
            "warmed": warm_key is not None,
        }
        return comp, meta
