"""A bearer token on every route of the vLLM servers the run starts, their control routes included.

vLLM's ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``); in dev mode
(``VLLM_SERVER_DEV_MODE=1``, which weight reloads need) ``/collective_rpc`` runs any worker method, ours
loading arbitrary weights (``infra.rollout.worker_ext``), and ``/sleep``, ``/reset_prefix_cache`` and the
rest are open. :class:`EngineTokenMiddleware` is handed to the server with ``--middleware`` (vLLM adds
it to the app) and answers 401 to any request without ``Authorization: Bearer <token>``, the token
read from :data:`TOKEN_ENV` in the server's environment; only ``/health`` stays open (readiness probes).
Tokens are compared as vLLM compares its API keys (sha256 digests, ``secrets.compare_digest``).
"""

from __future__ import annotations

import hashlib
import os
import secrets

TOKEN_ENV = "AGENTRL_ENGINE_TOKEN"
OPEN_PATHS = ("/health",)


class EngineTokenMiddleware:
    """Pure ASGI middleware: 401 unless the request carries the server's token (``/health`` excepted)."""

    def __init__(self, app) -> None:
        """Wrap ``app``; the token is ``$AGENTRL_ENGINE_TOKEN``.

        Raises:
            RuntimeError: the variable is unset or empty (a server must not start unguarded by mistake).
        """
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"EngineTokenMiddleware: ${TOKEN_ENV} is not set; the server would be unguarded")
        self.app, self._digest = app, hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(param.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        """Serve the request, or answer 401 when it lacks the token."""
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in OPEN_PATHS and not self._authorized(scope):
                from starlette.responses import JSONResponse

                await JSONResponse({"error": "Unauthorized: this engine needs its run's token"}, 401)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)
