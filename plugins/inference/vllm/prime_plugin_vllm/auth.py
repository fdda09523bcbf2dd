"""Every endpoint of a vLLM server started with an API key requires that key.

vLLM's own ``--api-key`` / ``VLLM_API_KEY`` guards only ``/v1`` (and a few other prefixes):
``/collective_rpc`` (which loads weights from any path the server can read),
``/reset_prefix_cache``, ``/sleep``, ``/server_info``, ``/metrics`` and ``/health`` answer
anyone. ``VLLMServer`` adds this middleware (``--middleware``) when a key is configured; it
reads the key from the server process's ``VLLM_API_KEY`` (set by ``VLLMServer``, never on the
command line) and refuses any request, on any path and method, without
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import hashlib
import hmac
import os

KEY_ENV = "VLLM_API_KEY"


class RequireApiKey:
    """A pure ASGI middleware (vLLM's ``--middleware`` adds classes as ``cls(app)``)."""

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _allowed(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if self._digest is None or scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized: this server requires its API key (Authorization: Bearer <key>)"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
