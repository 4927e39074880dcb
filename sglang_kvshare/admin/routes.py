"""The ``/kvshare/`` admin routes, mounted on SGLang's own FastAPI app.

``server/http_routes.py`` calls ``mount`` from a BEFORE hook on
``http_server._setup_and_run_http_server``: that function runs only in the
process that serves HTTP, receives the tokenizer manager and the IPC names
the channel needs, and runs before SGLang adds its API-key middleware and
starts uvicorn, so the routes appear in ``/openapi.json`` and the middleware
sees them (see ``mount`` for why they are added one by one). They are
mounted only when the server runs ``--radix-cache-backend kvshare``.

Auth reuses SGLang's own levels (``sglang.srt.utils.auth``): the write routes
and the pool reads are ``ADMIN_OPTIONAL`` like ``/flush_cache`` (the admin key
when the server has one, else the API key, else open; SGLang's middleware
answers 401): pools show agent names and content details, which a server with
only ``--admin-api-key`` must not publish. ``GET /kvshare/stats`` is ``NORMAL``
like ``/get_server_info`` (which carries the same snapshot). On a server with
no key at all the writes answer 403 unless ``--kvshare-admin-open true``:
anyone who reaches the port could otherwise switch every user's mode.

Data parallelism (``--dp-size > 1``, from the server args at mount time):
SGLang's RPC socket reaches one scheduler only, so the writes and pool reads
travel to every rank through the fan-out of ``GetInternalStateReq``
(``AdminChannel.fan_out``); the answers are merged (``aggregate``): stats
summed with ratios recomputed, pools tagged by rank, a write that failed or
went unanswered on any rank answered as an error naming the ranks.

SGLang turns FastAPI's body-validation errors into 400 for the whole app, so
``POST /kvshare/config`` parses its body itself and answers 422 with a
message; ``openapi_extra`` still documents the body schema.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from http import HTTPStatus
from typing import Any, Literal, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sglang_kvshare.admin import aggregate
from sglang_kvshare.admin.channel import AdminChannel, ChannelError
from sglang_kvshare.config import RUNTIME_FIELDS, KVShareConfig, live_config, set_live_config
from sglang_kvshare.guard.target import FidelityTarget
from sglang_kvshare.protocol import MAX_RECOMPUTE_HEAD

logger = logging.getLogger(__name__)

PREFIX = "/kvshare"
MAX_CAPACITY = 4096  # bounds that keep values inside SGLang's msgpack IPC (int64)
MAX_RANK = 65536
MAX_HEAD = MAX_RECOMPUTE_HEAD  # the bound a request's own recompute_head is held to

_HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(KVShareConfig)}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(KVShareConfig)}
_channel: Optional[AdminChannel] = None
_dp_size = 1  # the server's --dp-size, set by ``mount``
_keyed = True  # the server has --admin-api-key or --api-key (set by ``mount``)
_summaries: dict[str, Any] = {}  # name -> callable: more of the HTTP process's state in /kvshare/stats


class ConfigUpdate(BaseModel):
    """Body of ``POST /kvshare/config``: the settings to change (at least one; null = keep)."""

    model_config = ConfigDict(extra="forbid")

    tau: Optional[float] = Field(None, ge=0.0, le=1.0, strict=True, allow_inf_nan=False,
                                 description=_HELP["tau"])
    capacity: Optional[int] = Field(None, ge=2, le=MAX_CAPACITY, strict=True, description=_HELP["capacity"])
    rank: Optional[int] = Field(None, ge=0, le=MAX_RANK, strict=True, description=_HELP["rank"])
    edge_anchors: Optional[int] = Field(None, ge=2, le=MAX_CAPACITY, strict=True, description=_HELP["edge_anchors"])
    mode: Optional[Literal["off", "fullshared", "kvcmas"]] = Field(
        None, description="off | fullshared | kvcmas; switching between "
                          "fullshared and kvcmas starts with empty pools.")
    recompute_head: Optional[int] = Field(None, ge=0, le=MAX_HEAD, strict=True,
                                          description=_HELP["recompute_head"])
    recompute_ratio: Optional[float] = Field(None, ge=0.0, le=1.0, strict=True, allow_inf_nan=False,
                                             description=_HELP["recompute_ratio"])
    sparse_extend: Optional[bool] = Field(None, strict=True, description=_HELP["sparse_extend"])
    staged: Optional[bool] = Field(None, strict=True, description=_HELP["staged"])
    verify_rate: Optional[float] = Field(None, ge=0.0, le=1.0, strict=True, allow_inf_nan=False,
                                         description=_HELP["verify_rate"])
    fidelity_target: Optional[str] = Field(None, max_length=64, description=_HELP["fidelity_target"]
                                           + " An empty string clears it.")
    fidelity_min_samples: Optional[int] = Field(None, ge=2, le=100000, strict=True,
                                                description=_HELP["fidelity_min_samples"])
    fidelity_band: Optional[float] = Field(None, ge=0.0, lt=1.0, strict=True, allow_inf_nan=False,
                                           description=_HELP["fidelity_band"])
    verify_burst: Optional[bool] = Field(None, strict=True, description=_HELP["verify_burst"])

    @model_validator(mode="after")
    def _not_empty(self) -> "ConfigUpdate":
        if not self.changes():
            raise ValueError(f"nothing to change: give at least one of {', '.join(RUNTIME_FIELDS)}")
        if self.fidelity_target:
            FidelityTarget.parse(self.fidelity_target)
        return self

    def changes(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    """SGLang's error shape (``ErrorResponse``): object, message, type, code."""
    body = {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "code": status, **extra}
    return JSONResponse(body, status_code=status)


def _channel_or_error() -> AdminChannel:
    if _channel is None:
        raise ChannelError("the kvshare admin channel is not set up in this process")
    return _channel


async def _read() -> dict:
    """Config and stats of every DP rank, merged (``aggregate.merge_stats``)."""
    return aggregate.merge_stats(await _channel_or_error().read())


def admin_auth(func):
    """SGLang's ``ADMIN_OPTIONAL`` level: the admin key when set, else the API key, else open."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    return auth_level(AuthLevel.ADMIN_OPTIONAL)(func)


router = APIRouter(prefix=PREFIX, tags=["kvshare"])

_ERRORS = {401: {"description": "API key missing or wrong (SGLang's key rules)"},
           503: {"description": "the scheduler does not run the kvshare cache"}}


@router.get("/stats", responses=_ERRORS, summary="Reuse counters, totals and per slot")
async def get_stats():
    """Totals and per slot: requests, shared tokens seen, tokens resolved by hit /
    alignment / correction, reuse ratio, fallbacks by reason, anchors, bytes, mean gate entropy."""
    try:
        snap = await _read()
    except ChannelError as exc:
        return error(exc.status, str(exc))
    extra = {name: provider() for name, provider in _summaries.items()}
    return {"config": snap["config"], **snap["stats"], "dp_size": snap["dp_size"], "ranks": snap["ranks"],
            **extra}


_DP_RANKS = {502: {"description": "--dp-size > 1: a data-parallel rank did not answer (named)"}}


def unkeyed_write_error(op: str) -> Optional[JSONResponse]:
    """A 403 for a write on a server without keys, unless the operator opened the writes."""
    if op == "pools" or _keyed or live_config().admin_open:
        return None
    return error(403, f"kvshare admin op {op!r} needs a key: start the server with --admin-api-key KEY (or "
                       "--api-key KEY) and send it as 'Authorization: Bearer KEY', or allow writes without a key "
                       "with --kvshare-admin-open true")


async def _call(op: str, **params: Any) -> JSONResponse:
    """Run one op in the scheduler (every DP rank's); a 403 for an unkeyed write unless writes are open."""
    refused = unkeyed_write_error(op)
    if refused is not None:
        return refused
    params = {k: v for k, v in params.items() if v is not None}
    try:
        if _dp_size > 1:
            reply = aggregate.merge_replies(op, await _channel_or_error().fan_out(op, **params), _dp_size)
        else:
            reply = await _channel_or_error().call(op, **params)
    except ChannelError as exc:
        return error(exc.status, str(exc))
    if not reply.ok:
        return error(reply.status, reply.message, **reply.result)
    if op == "configure" and "config" in reply.result:
        # The HTTP process follows the switch (the chat layer and validation read live_config()).
        set_live_config(KVShareConfig(**{k: v for k, v in reply.result["config"].items()
                                         if k in _CONFIG_FIELDS}))
    return JSONResponse({"message": reply.message, **reply.result})


@router.get("/pools", responses={**_ERRORS, **_DP_RANKS}, summary="Anchor pools of every slot")
@admin_auth
async def get_pools():
    """Per slot, each anchor: id, length, age, activations, consumers/edges, rank, bytes."""
    response = await _call("pools")
    if response.status_code == 200:
        return {"pools": json.loads(response.body)["pools"]}
    return response


@router.get("/pools/{slot:path}", responses={**_ERRORS, **_DP_RANKS, 404: {"description": "unknown slot"}},
            summary="Anchor pool of one slot")
@admin_auth
async def get_pool(slot: str):
    response = await _call("pools", slot=slot)
    if response.status_code == 200:
        return {"slot": slot, "anchors": json.loads(response.body)["pools"].get(slot, [])}
    return response


_CONFIG_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ConfigUpdate.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@router.post("/config", openapi_extra=_CONFIG_BODY,
             responses={**_ERRORS, **_DP_RANKS, 422: {"description": "invalid body; `message` says what to fix"}},
             summary="Change tau, capacity, rank or mode, atomically")
@admin_auth
async def post_config(request: Request):
    """Validate and apply the change in the scheduler between two batches (all or
    nothing); answers the new config. The next request runs under it."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return error(422, f"body is not valid JSON: {exc}")
    if not isinstance(data, dict):
        return error(422, "body must be a JSON object with at least one of tau, capacity, rank, mode")
    try:
        update = ConfigUpdate.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        message = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5])
        return error(422, f"invalid kvshare config: {message}", errors=errors)
    return await _call("configure", **update.changes())


@router.post("/pools/{slot:path}/reset", responses={**_ERRORS, **_DP_RANKS, 404: {"description": "unknown slot"}},
             summary="Empty one slot's anchor pool and records")
@admin_auth
async def reset_pool(slot: str):
    return await _call("reset", slot=slot)


@router.post("/save", responses={**_ERRORS, **_DP_RANKS,
                                 409: {"description": "no --kvshare-pool-file, or a mode without anchor pools"},
                                 500: {"description": "the pool file could not be written (the old one is kept)"}},
             summary="Write the anchor pools to --kvshare-pool-file")
@admin_auth
async def save_pools():
    """Write every anchor pool to the server's pool file (each data-parallel and tensor-parallel rank its own),
    which the next launch with the same ``--kvshare-pool-file`` loads. Answers the path, slots, anchors and
    bytes written."""
    return await _call("save")


@router.post("/reset", responses={**_ERRORS, **_DP_RANKS}, summary="Empty every anchor pool and record")
@admin_auth
async def reset_all():
    return await _call("reset")


# ------------------------------------------------------------ mounting
def mount(app: Any, tokenizer_manager: Any, rpc_endpoint: str, *, dp_size: int = 1, keyed: bool = True,
          summaries: Optional[dict[str, Any]] = None) -> None:
    """Add the routes to ``app`` and open the channel (idempotent).

    ``dp_size`` is the server's ``--dp-size``: above 1 the writes and pool reads fan out to every rank.
    ``keyed``: the server has an API or admin key; without one the writes answer
    403 unless ``--kvshare-admin-open`` (``KVShareConfig.admin_open``).
    ``summaries``: name -> callable returning a dict that ``GET /kvshare/stats``
    adds under that name (the fidelity guard's summary).

    NOTE: each route is added to the app itself, not through
    ``app.include_router``: FastAPI >= 0.165 keeps an included router as one
    lazy route without an endpoint, and SGLang's API-key middleware reads the
    auth level from the matched route's endpoint, so it would treat every
    included route as NORMAL and let writes through without the admin key.
    """
    global _channel, _dp_size, _keyed
    _channel = AdminChannel(tokenizer_manager, rpc_endpoint)
    _dp_size = int(dp_size or 1)
    _keyed = keyed
    _summaries.clear()
    _summaries.update(summaries or {})
    mounted = {getattr(r, "path", None) for r in app.router.routes}
    for route in router.routes:
        if route.path in mounted:
            continue
        app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name,
                          summary=route.summary, description=route.description, responses=route.responses,
                          tags=route.tags, openapi_extra=route.openapi_extra)
