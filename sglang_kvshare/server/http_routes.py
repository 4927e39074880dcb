"""Mount the kvshare routes on SGLang's HTTP app: ``/kvshare/*`` (admin) and ``/kvshare/chat``.

Why a BEFORE hook on ``http_server._setup_and_run_http_server``
(``sglang_targets.SETUP_HTTP_SERVER``): it runs only in the process that
serves HTTP, receives the tokenizer manager and the IPC names the admin
channel needs, and runs before SGLang adds its API-key middleware and starts
uvicorn, so the routes appear in ``/openapi.json`` and the middleware sees
them. Nothing is mounted unless the server runs ``--radix-cache-backend kvshare``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sglang_kvshare.config import BACKEND_NAME, live_config
from sglang_kvshare.guard.serving import guard
from sglang_kvshare.admin import routes
from sglang_kvshare.server.sglang_targets import SETUP_HTTP_SERVER

logger = logging.getLogger(__name__)


def before_setup_http_server(*args: Any, **kwargs: Any) -> None:
    """Mount the admin and chat-stats routes when the kvshare backend is on; never changes the call."""
    names = SETUP_HTTP_SERVER.params or ()
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    server_args, port_args = bound.get("server_args"), bound.get("port_args")
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return None
    if bound.get("tokenizer_manager") is None or port_args is None:
        logger.warning("sglang-kvshare: routes not mounted (no tokenizer manager in this process)")
        return None
    from sglang_kvshare.chat import hooks as chat_hooks

    guard.attach_file(live_config().fidelity_file)
    app = _http_app()
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    keyed = bool(getattr(server_args, "admin_api_key", None) or getattr(server_args, "api_key", None))
    routes.mount(app, bound["tokenizer_manager"], port_args.rpc_ipc_name, dp_size=dp_size, keyed=keyed,
                 summaries={"fidelity": guard.summary})
    chat_hooks.mount_stats_route(app)
    mount_fidelity_routes(app)
    chat_hooks.outputs.max_bytes = int(live_config().chat_memory_mb * 2**20)
    logger.info("sglang-kvshare: routes mounted under %s/", routes.PREFIX)
    return None


class PinBody(BaseModel):
    """Body of ``POST /kvshare/fidelity/pin``."""

    model_config = ConfigDict(extra="forbid")

    scope: str = Field(min_length=1, max_length=300, description="the scope as GET /kvshare/fidelity shows it")
    setting: Optional[str] = Field(description="dense, headK (e.g. head16), or null to unpin")


async def get_fidelity():
    """Per scope: the setting in force, the 95 % intervals of top-1 agreement and KL, samples; the guard's
    actions and queue."""
    return guard.snapshot()


async def post_fidelity_pin(request: Request):
    """Pin one scope to a setting (or unpin it): the guard keeps measuring, never moves it."""
    refused = routes.unkeyed_write_error("fidelity_pin")
    if refused is not None:
        return refused
    try:
        body = PinBody.model_validate(json.loads(await request.body() or b"null"))
    except (ValueError, ValidationError) as exc:
        return routes.error(422, f"invalid pin: {exc}; send {{\"scope\": ..., \"setting\": \"head16\"|\"dense\"|null}}")
    try:
        return {"scope": body.scope, **guard.pin(body.scope, body.setting)}
    except KeyError:
        return routes.error(404, f"unknown scope {body.scope!r}; GET /kvshare/fidelity lists the scopes")
    except ValueError as exc:
        return routes.error(422, str(exc))


async def post_fidelity_reset():
    """Start the guard afresh: every scope's estimates, settings and pins, its counters and actions (not the
    launch settings). For a new deployment of the agents, or a benchmark's next arm."""
    refused = routes.unkeyed_write_error("fidelity_reset")
    if refused is not None:
        return refused
    guard.reset()
    return {"reset": True}


def mount_fidelity_routes(app: Any) -> None:
    """``GET /kvshare/fidelity``, ``POST /kvshare/fidelity/pin`` and ``/reset`` at SGLang's ``ADMIN_OPTIONAL`` level
    (they name agents), added one by one like the admin routes (idempotent)."""
    mounted = {getattr(r, "path", None) for r in app.router.routes}
    for path, endpoint, methods in (("/kvshare/fidelity", get_fidelity, ["GET"]),
                                    ("/kvshare/fidelity/pin", post_fidelity_pin, ["POST"]),
                                    ("/kvshare/fidelity/reset", post_fidelity_reset, ["POST"])):
        if path not in mounted:
            app.add_api_route(path, routes.admin_auth(endpoint), methods=methods, tags=["kvshare"],
                              summary=(endpoint.__doc__ or "").split("\n")[0])


def _http_app() -> Any:
    """SGLang's FastAPI app (imported late: the import loads the whole HTTP server)."""
    from sglang.srt.entrypoints.http_server import app

    return app
