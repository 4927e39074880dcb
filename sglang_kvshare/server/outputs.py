"""The one hook on ``TokenizerManager.generate_request``: the outputs of annotated requests, as they pass.

First, a request that came through SGLang's router gets its annotation and
workflow back where kvshare reads them (``routing.adopt_generate``). Every
request goes through this generator; a request without an annotation
(and not annotated by the chat layer) gets SGLang's own generator, untouched.
For an annotated one, in this order per output:

1. the fidelity guard (``guard.serving``) collects what it verifies, adds its
   part to the report and takes out the logprobs the client did not ask for;
2. ``cached_tokens`` is brought back to SGLang's meaning (``chat.hooks.exact_cached_tokens``);
3. the chat layer's track records the answer (``chat.hooks``).

Before the request runs, its DP worker is named from its reuse scope
(``server.affinity``, with ``--dp-size`` > 1) and the guard applies its
scope's setting; after the
answer, it queues the verification. One hook composes both layers because
SGLang patches a target once and the two must see the same outputs in order.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang_kvshare.chat import hooks as chat_hooks
from sglang_kvshare.guard.serving import Collector, guard
from sglang_kvshare import routing
from sglang_kvshare.server import affinity

logger = logging.getLogger(__name__)


def around_generate(original, self, obj, request=None):
    """AROUND hook: tap annotated requests; pass every other request to SGLang as it is."""
    try:
        routing.adopt_generate(obj, request)  # an annotation the router moved, a workflow it names
    except Exception:  # noqa: BLE001 - a request is never refused because of where its fields travelled
        logger.exception("sglang-kvshare: reading a routed request's annotation failed")
    track = chat_hooks.track_for(obj)
    if track is None and not chat_hooks.annotated(obj):
        return original(self, obj, request)
    try:
        affinity.route(obj, self)
    except Exception:  # noqa: BLE001 - a request is never refused because its worker could not be named
        logger.exception("sglang-kvshare: naming the request's DP worker failed; SGLang balances it")
    collector = guard.prepare(obj, self)
    # NOTE: SGLang sends deltas only for streams on a server with incremental streaming output.
    incremental = bool(getattr(self, "incremental_streaming_output", False)) and bool(getattr(obj, "stream", False))
    return _tap(original(self, obj, request), track, collector, incremental)


async def _tap(generator: Any, track: Optional[Any], collector: Optional[Collector], incremental: bool):
    try:
        async for out in generator:
            if isinstance(out, dict):
                if collector is not None:
                    collector.observe(out, incremental)
                chat_hooks.exact_cached_tokens(out.get("meta_info") or {})
                if track is not None:
                    track.observe(out, incremental)
            yield out
    finally:
        await generator.aclose()
        if collector is not None:
            collector.finish()
