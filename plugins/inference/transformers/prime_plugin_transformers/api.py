"""The HTTP API of one server (JSON over HTTP/1.1, the standard library's threading server).

    GET  /health            200 once the engine serves; 503 while it loads; 500 once it died
    GET  /v1/info           the model, the weights served and their step
    POST /v1/sample         {prompt_ids, n, max_tokens, temperature, top_p, stop_token_ids}
                            -> {"samples": [{token_ids, logprobs, finish_reason, text}, ...]}
    POST /v1/load_weights   {path, step} -> {step, path, seconds, waited, how}

Errors answer ``{"error": message}``: 400 for a request that cannot be served as it is (bad
token ids, too long, a folder that is not this model's weights), 503 while loading, 500 when
the engine failed. One thread per connection: a request waits for its samples in its thread.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("prime.transformers")

MAX_BODY = 64 * 1024**2


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of concurrent samples connect at once


class Handler(BaseHTTPRequestHandler):
    """Serves ``state`` (set by ``handler``): ``state.engine`` is the ``Engine`` once loaded,
    else ``None``; ``state.failure`` says why loading failed."""

    protocol_version = "HTTP/1.1"  # keep-alive: the client reuses connections
    server_version = "prime-transformers"
    state = None

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
            log.debug("client of %s left before its answer", self.path)

    def _engine(self):
        engine = self.state.engine
        if engine is None:
            failure = self.state.failure
            self._reply(500 if failure else 503, {"error": failure or "the model is still loading"})
        return engine

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path not in ("/health", "/v1/info"):
            self._reply(404, {"error": f"no endpoint GET {self.path}"})
            return
        engine = self._engine()
        if engine is None:
            return
        if self.path == "/v1/info":
            self._reply(200, engine.info())
        elif engine.alive():
            self._reply(200, {"ok": True})
        else:
            self._reply(500, {"error": engine.death()})

    def do_POST(self):  # noqa: N802
        from prime_plugin_transformers.params import BadRequest
        from prime_plugin_transformers.weights import WeightsError

        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._reply(413, {"error": f"request body of {length} bytes is over {MAX_BODY}"})
            return
        raw = self.rfile.read(length)
        if self.path not in ("/v1/sample", "/v1/load_weights"):
            self._reply(404, {"error": f"no endpoint POST {self.path}"})
            return
        engine = self._engine()
        if engine is None:
            return
        try:
            body = json.loads(raw or b"{}")
            if self.path == "/v1/sample":
                self._reply(200, {"samples": engine.sample(body)})
            else:
                self._reply(200, engine.load_weights(str(body["path"]), body.get("step")))
        except KeyError as exc:
            self._reply(400, {"error": f"missing key {exc} in the request"})
        except (BadRequest, WeightsError, json.JSONDecodeError) as exc:
            self._reply(400, {"error": str(exc)})
        except Exception as exc:  # the engine's failure, reported to the client that asked
            log.exception("%s failed", self.path)
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

    def log_message(self, format, *args):  # one line per request, only at debug level
        log.debug("%s %s", self.address_string(), format % args)


def handler(state) -> type[Handler]:
    """A handler class serving ``state``."""
    return type("BoundHandler", (Handler,), {"state": state})
