"""The ``transformers`` backend's client: how the orchestrator samples from and updates one server.

``sample`` posts the request to ``/v1/sample`` and turns the answer into ``Sample``s;
``load_weights`` posts the published folder to ``/v1/load_weights`` (full Hugging Face weights,
or a transport's descriptor the server reads; a LoRA adapter folder is refused here, before
the server is asked). ``seed`` and
``session_id`` are not sent: the server has no per-request seeds and one replica has no
prefix cache to keep a session on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prime_core.errors import PrimeError
from prime_core.inference.client import Sample, SampleRequest

ATTEMPTS = 3
"""Tries of a request whose connection broke before an answer (sampling again is harmless)."""


class TransformersClient:
    """Client of one server; ``base_url`` is its API root (``http://host:port/v1``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self._http = None
        self._loop = None

    def health(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.root}/health", timeout=5.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _client(self):
        """The HTTP client of the running event loop (a client is bound to the loop it was first used on)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # Idle connections are dropped before a server would drop them, never reused as it does.
            self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout,
                                           limits=httpx.Limits(max_connections=None, keepalive_expiry=2.0),
                                           trust_env=False)
            self._loop = loop
        return self._http

    async def _post(self, path: str, what: str, body: dict, timeout: float | None = None) -> dict:
        import httpx

        timeout = timeout or self.timeout
        for attempt in range(ATTEMPTS):
            try:
                response = await self._client().post(path, json=body, timeout=timeout)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
                if attempt == ATTEMPTS - 1:
                    raise PrimeError(f"{what} at {self.root} failed {ATTEMPTS} times: {type(exc).__name__}: {exc}",
                                     hint="is the inference server still running? see its log under "
                                          "output_dir/logs/") from None
                await asyncio.sleep(0.5 * (attempt + 1))
            except httpx.TimeoutException:
                raise PrimeError(f"{what} at {self.root}: no answer within {timeout:g} s",
                                 hint="raise orchestrator.client.timeout, or lower sampling.max_tokens") from None
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": response.text[:500]}
        if response.status_code != 200:
            raise PrimeError(f"{what} at {self.root} failed (HTTP {response.status_code}): "
                             f"{answer.get('error', answer)}")
        return answer

    async def sample(self, request: SampleRequest) -> list[Sample]:
        body = {"prompt_ids": list(request.prompt_ids), "n": request.n, "max_tokens": request.max_tokens,
                "temperature": request.temperature, "top_p": request.top_p,
                "stop_token_ids": list(request.stop_token_ids)}
        answer = await self._post("/sample", "sampling", body)
        try:
            return [Sample(token_ids=[int(t) for t in s["token_ids"]], logprobs=[float(x) for x in s["logprobs"]],
                           finish_reason=str(s["finish_reason"]), text=str(s["text"])) for s in answer["samples"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise PrimeError(f"unexpected answer from the transformers server at {self.root} "
                             f"({type(exc).__name__}: {exc}): {str(answer)[:300]}") from None

    async def load_weights(self, step: int, path: str) -> str | None:
        from prime_core.weights import is_adapter

        if is_adapter(Path(path)):
            raise PrimeError(f"loading {path} into the transformers server at {self.root}: it is a LoRA adapter, "
                             "which this backend does not serve",
                             hint="train without trainer.model.lora, or use inference.backend = 'vllm'")
        from prime_plugin_transformers.received_weights import answer_within, is_broadcast

        answer = await self._post("/load_weights", f"loading weights of step {step} ({path})",
                                  {"path": str(path), "step": step},
                                  timeout=answer_within(path) if is_broadcast(path) else None)
        served = answer.get("step", step) if isinstance(answer, dict) else step
        # weight_broadcast.type = 'ipc': the slot may already hold a newer version, which was loaded
        return None if served in (None, step) else f"step {served}, newer (step {step}'s shared slot was reused)"

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
