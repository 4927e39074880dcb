"""Reject malformed kvshare annotations in the HTTP process, with a 400.

Why a hook on ``TokenizerManager._validate_one_request``: it runs after
tokenization (the spans are checked against the real ``input_ids``) and any
``ValueError`` it raises is SGLang's own path to an HTTP 400 with the
message, before the request reaches the scheduler. Nothing else changes.
"""

from __future__ import annotations

from sglang_kvshare.config import live_config
from sglang_kvshare.protocol import check_extra_key, parse_annotation


def validate_annotation_after(result, _manager, obj, input_ids, *args, **kwargs):
    """AFTER hook: raises ``AnnotationError`` (a ``ValueError``) for a bad annotation or a reserved extra_key."""
    check_extra_key(getattr(obj, "extra_key", None))
    sampling = getattr(obj, "sampling_params", None)
    if isinstance(sampling, dict) and input_ids is not None:
        parse_annotation(sampling.get("custom_params"), len(input_ids), live_config().max_segments)
    return result
