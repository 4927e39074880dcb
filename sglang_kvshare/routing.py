"""SGLang's router in front of kvshare servers: the client's header, and where a routed request's
annotation and workflow travel.

``routing_headers`` (client side): the header that pins a workflow to one
server behind the router's ``manual`` policy (docs/SCALING.md).

Why: sglang-router (0.3.x) re-serializes each body into its own request types
before forwarding it. On ``/generate`` it drops ``sampling_params.custom_params``
(the annotation) but keeps ``custom_labels``; on the chat API it drops the
``kvshare`` field and ``user`` but keeps ``metadata``; of the headers it keeps
its routing key (``X-SMG-Routing-Key``). So a client behind the router sends
the annotation also as ``custom_labels["kvshare"]`` (``/generate``; the client
library does) or ``metadata["kvshare"]`` (chat, a JSON string), and the
routing key names the workflow. This module puts both back where kvshare reads
them, before SGLang or any other hook sees the request:

* an annotation under ``custom_labels`` moves into ``custom_params`` (the label
  is removed either way: SGLang would turn it into a Prometheus label);
* a request that names no workflow gets the routing key as its workflow. The
  key picked the server, so it already names the requests that meet there;
  as a reuse scope it can only narrow what a request may reuse, never widen it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from sglang_kvshare.protocol import CUSTOM_PARAMS_KEY, MAX_NAME_CHARS

# The header SGLang's router (sglang-router, ``--policy manual``) pins to one server: a workflow's
# requests meet where its copies and pools are.
ROUTING_HEADER = "X-SMG-Routing-Key"


def routing_headers(workflow: Optional[str]) -> dict[str, str]:
    """The HTTP header that keeps a workflow's requests on one server behind SGLang's router; empty
    without a workflow. For OpenAI-style clients: ``OpenAI(..., default_headers=routing_headers(wf))``."""
    if workflow is None:
        return {}
    if not isinstance(workflow, str) or not workflow or len(workflow) > MAX_NAME_CHARS:
        raise ValueError(f"a workflow name is a string of 1 to {MAX_NAME_CHARS} characters, got {workflow!r}")
    return {ROUTING_HEADER: workflow}


def routed_fields(annotation: Any) -> dict:
    """Body fields that carry ``annotation`` (a ``protocol.Annotation``) through the router: the client
    library adds them to the ``/generate`` body of a named workflow (the router drops ``custom_params``)."""
    if getattr(annotation, "workflow", None) is None:
        return {}
    return {"custom_labels": annotation.to_custom_params()}


def routing_key(request: Any) -> Optional[str]:
    """The router's key from a FastAPI request's headers, or None (none, empty or over-long)."""
    headers = getattr(request, "headers", None)
    value = headers.get(ROUTING_HEADER) if headers is not None else None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS else None


def adopt_generate(obj: Any, request: Any) -> None:
    """Move a routed ``/generate`` annotation into place and name its workflow from the routing key.

    Single requests only (a batch keeps what it carries). A malformed annotation
    is left for the validation hook, which answers it with a 400.
    """
    labels = getattr(obj, "custom_labels", None)
    carried = labels.pop(CUSTOM_PARAMS_KEY, None) if isinstance(labels, dict) else None
    if isinstance(labels, dict) and not labels:
        obj.custom_labels = None
    sampling = getattr(obj, "sampling_params", None)
    if not isinstance(sampling, dict):
        return
    custom = sampling.get("custom_params")
    if carried is not None and not (isinstance(custom, dict) and CUSTOM_PARAMS_KEY in custom):
        custom = {**(custom if isinstance(custom, dict) else {}), CUSTOM_PARAMS_KEY: carried}
        sampling["custom_params"] = custom
    key = routing_key(request)
    raw = custom.get(CUSTOM_PARAMS_KEY) if isinstance(custom, dict) else None
    if key is None or not isinstance(raw, str):
        return
    try:
        annotation = json.loads(raw)
    except ValueError:
        return
    if isinstance(annotation, dict) and annotation.get("workflow") is None:
        annotation["workflow"] = key
        custom[CUSTOM_PARAMS_KEY] = json.dumps(annotation)


def chat_field(body: Any) -> Any:
    """A chat body's ``kvshare`` field, or the one a router-safe client put in ``metadata["kvshare"]``
    (a JSON string; text that is not JSON is returned as is, for the parser to refuse)."""
    if not isinstance(body, dict):
        return None
    if CUSTOM_PARAMS_KEY in body:
        return body[CUSTOM_PARAMS_KEY]
    metadata = body.get("metadata")
    carried = metadata.get(CUSTOM_PARAMS_KEY) if isinstance(metadata, dict) else None
    if not isinstance(carried, str):
        return None
    try:
        return json.loads(carried)
    except ValueError:
        return carried
