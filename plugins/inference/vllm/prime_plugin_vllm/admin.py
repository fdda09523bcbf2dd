"""Control a running vLLM server: health, live weight updates, prefix-cache reset.

The endpoints used here live at the server root (not under ``/v1``) and exist only when the
server runs with ``VLLM_SERVER_DEV_MODE=1``, which ``VLLMServer`` sets.

Weights are reloaded through ``POST /collective_rpc`` with the worker extension's
``prime_reload_weights`` (``worker_ext.py``), which runs the worker's built-in
``reload_weights``: a layerwise reload that restores the checkpoint-format parameters, loads
the new tensors and re-runs vLLM's post-load processing (repacking on CPU). Loading into the
live model with ``model.load_weights`` instead fails or silently does nothing on CPU, because
vLLM-CPU repacks linear weights after loading. The extension also re-packs tied layers
(``lm_head``) that the built-in reload leaves with their old weights on CPU.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from prime_core.errors import PrimeError

log = logging.getLogger("prime.vllm")


def _rpc(method: str, **kwargs: str) -> dict:
    return {"method": method, "args": [], "kwargs": kwargs}


def _error_text(response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:
        return response.text[:2000]


class VLLMAdmin:
    """Admin client of one vLLM server; ``base_url`` is its OpenAI URL (``http://h:p/v1``)."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, transport=None, api_key: str | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        # No keep-alive: admin calls are rare, and uvicorn drops the connection after a failed
        # call, which would break the next request sent on it. A server with a key wants it on
        # every endpoint, the admin ones and /health included (auth.py).
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.Client(base_url=self.root, timeout=timeout, headers=headers,
                                    limits=httpx.Limits(max_keepalive_connections=0), transport=transport)
        self._builtin_reload = False

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> VLLMAdmin:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, path: str, what: str, **kwargs):
        import httpx

        try:
            response = self._client.post(path, **kwargs)
        except httpx.HTTPError as exc:
            raise PrimeError(f"{what} failed: no answer from the vLLM server at {self.root}: {exc}") from None
        if response.status_code == 404 and "lora_adapter" in path:
            raise PrimeError(
                f"{what} failed: {self.root}{path} does not exist (HTTP 404)",
                hint="the server must run with LoRA enabled and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                     "(prime's vllm backend does both when inference.lora is set)",
            )
        if response.status_code == 401:
            raise PrimeError(f"{what} failed: the vLLM server at {self.root} refused the API key (HTTP 401)",
                             hint="give the orchestrator the server's key: orchestrator.client.api_key_var / "
                                  "api_key_file (in `prime run` they follow inference.server's)")
        if response.status_code == 404:
            raise PrimeError(
                f"{what} failed: {self.root}{path} does not exist (HTTP 404)",
                hint="the server must run with VLLM_SERVER_DEV_MODE=1 (prime's vllm backend sets it)",
            )
        if response.status_code != 200:
            raise PrimeError(f"{what} failed: HTTP {response.status_code} from {self.root}{path}: "
                             f"{_error_text(response)}")
        return response

    def health(self) -> bool:
        """Whether ``GET /health`` answers 200 (the engine is up)."""
        import httpx

        try:
            return self._client.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def requests_served(self) -> float | None:
        """Completions requests this server answered with success since it started (its
        ``/metrics``), or ``None`` when it does not say."""
        import httpx

        try:
            response = self._client.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        # No line yet: no completions request answered yet.
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
                   if line.startswith("http_requests_total{") and 'handler="/v1/completions"' in line
                   and 'status="2xx"' in line)

    def collective_rpc(self, method: str, *, args: list[str] | None = None, kwargs: dict[str, str] | None = None,
                       timeout: float | None = None) -> list:
        """Call ``method`` on every worker; returns one result per worker (``[]`` when none come back).

        Only strings travel: vLLM passes ``args``/``kwargs`` through unchanged.
        """
        body: dict = {"method": method, "args": list(args or []), "kwargs": dict(kwargs or {})}
        if timeout is not None:
            body["timeout"] = timeout
        response = self._post("/collective_rpc", f"collective_rpc {method!r}", json=body)
        if not response.content:
            return []
        return response.json().get("results", [])

    def update_weights(self, path: str | Path) -> None:
        """Load the Hugging Face checkpoint folder ``path`` (as the server sees it) into the server.

        Then reset the prefix cache, so that no KV computed with the old weights is reused.
        """
        path = str(path)
        what = f"update_weights({path})"
        if self._builtin_reload:
            self._post("/collective_rpc", what, json=_rpc("reload_weights", weights_path=path))
        else:
            try:
                self._post("/collective_rpc", what, json=_rpc("prime_reload_weights", weights_path=path))
            except PrimeError as exc:
                if "has no attribute 'prime_reload_weights'" not in str(exc):
                    raise
                # A server started without prime's worker extension: vLLM's own reload (on CPU,
                # a tied lm_head then keeps its old packed weights).
                log.warning("vLLM at %s runs without %s; using its built-in reload_weights",
                            self.root, "prime_plugin_vllm.worker_ext.PrimeWorkerExtension")
                self._builtin_reload = True
                self._post("/collective_rpc", what, json=_rpc("reload_weights", weights_path=path))
        if not self.reset_prefix_cache():
            log.warning("vLLM at %s kept its prefix cache after the weight update: requests still "
                        "running hold KV blocks; their prefixes may be reused once", self.root)

    def receive_weights(self, path: str | Path) -> dict:
        """Receive the version announced in the folder ``path`` (``BROADCAST.json``, the ``nccl``
        weight transport) from the trainer's process group, then reset the prefix cache.

        Blocks while the trainer sends; vLLM runs no engine step meanwhile, so requests in
        flight are held and go on with the new weights."""
        from prime_plugin_vllm.broadcast import DESCRIPTOR, read_descriptor

        descriptor = Path(path) / DESCRIPTOR
        # Joining waits for the other receivers and the transfer for the trainer, each bounded
        # by weight_broadcast.timeout on the worker's side: wait here a little longer than both.
        wait = 2 * float(read_descriptor(descriptor)["timeout"]) + 60.0
        body = _rpc("prime_receive_weights", descriptor=str(descriptor), label=self.root)
        response = self._post("/collective_rpc", f"receiving policy weights ({descriptor})", json=body, timeout=wait)
        results = response.json().get("results", []) if response.content else []
        # One try: while requests run vLLM keeps the cache, and the client's per-version
        # cache_salt already keeps new requests off the old blocks.
        self.reset_prefix_cache(attempts=1)
        return results[0] if results else {}

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the LoRA adapter folder ``path`` under the model name ``name`` (a new name per
        version: vLLM's in-place reload re-reads the files on every engine step)."""
        self._post("/v1/load_lora_adapter", f"load_adapter({name}, {path})",
                   json={"lora_name": name, "lora_path": str(path)})

    def unload_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", f"unload_adapter({name})", json={"lora_name": name})

    def reset_prefix_cache(self, *, attempts: int = 20, delay: float = 0.1) -> bool:
        """Drop the server's prefix cache; ``False`` when running requests kept it busy throughout
        (vLLM refuses to reset while blocks are held; this retries ``attempts`` times)."""
        for attempt in range(attempts):
            response = self._post("/reset_prefix_cache", "reset_prefix_cache")
            try:
                ok = bool(response.json().get("success", True))
            except ValueError:  # older vLLM: an empty 200
                ok = True
            if ok:
                return True
            if attempt + 1 < attempts:
                time.sleep(delay)
        return False
