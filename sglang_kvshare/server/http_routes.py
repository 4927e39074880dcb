"""Mount the kvshare routes on SGLang's HTTP app: ``/kvshare/*`` (admin) and ``/kvshare/chat``.

Why a BEFORE hook on ``http_server._setup_and_run_http_server``
(``sglang_targets.SETUP_HTTP_SERVER``): it runs only in the process that
serves HTTP, receives the tokenizer manager and the IPC names the admin
channel needs, and runs before SGLang adds its API-key middleware and starts
uvicorn, so the routes appear in ``/openapi.json`` and the middleware sees
them. Nothing is mounted unless the server runs ``--radix-cache-backend kvshare``.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_kvshare.config import BACKEND_NAME, live_config
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
    from sglang_kvshare.admin import routes
    from sglang_kvshare.chat import hooks as chat_hooks

    app = _http_app()
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    keyed = bool(getattr(server_args, "admin_api_key", None) or getattr(server_args, "api_key", None))
    routes.mount(app, bound["tokenizer_manager"], port_args.rpc_ipc_name, dp_size=dp_size, keyed=keyed)
    chat_hooks.mount_stats_route(app)
    chat_hooks.outputs.max_bytes = int(live_config().chat_memory_mb * 2**20)
    if dp_size > 1:
        logger.warning("sglang-kvshare: --dp-size %d: the kvshare write and pool routes answer 501 "
                       "(SGLang's RPC channel reaches one rank only); /kvshare/stats shows rank 0", dp_size)
    logger.info("sglang-kvshare: routes mounted under %s/", routes.PREFIX)
    return None


def _http_app() -> Any:
    """SGLang's FastAPI app (imported late: the import loads the whole HTTP server)."""
    from sglang.srt.entrypoints.http_server import app

    return app
