"""The ``vllm`` backend's client: how the orchestrator samples from and updates one vLLM server.

Sampling is ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
``logprobs: 0`` (the sampled token's log-probability; the server runs with
``--logprobs-mode processed_logprobs``, so temperature is applied). The model name is the
server's base model (``GET /v1/models``) until a LoRA adapter is loaded, then the newest
adapter. ``session_id`` travels as the ``X-Session-ID`` header, which routers in front of
vLLM (vllm-router's ``consistent_hash``) use to keep a trajectory on one engine.

Scoring given tokens (a teacher in on-policy distillation) is a one-token completion with
``prompt_logprobs: 0``: each prompt token's log-probability from the prefill.

Weights go through ``VLLMAdmin`` (``admin.py``): a full checkpoint is reloaded in place; a
LoRA adapter is loaded under a new name per step, ``<base model>-lora-step-N`` (vLLM's
in-place adapter reload re-reads the files on every engine step), requests switch to it,
and the adapter before the previous one is unloaded (the previous may still be finishing
requests).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prime_core.errors import PrimeError
from prime_core.inference.client import Sample, SampleRequest

KEEP_ADAPTERS = 2
"""LoRA adapters kept loaded: the newest, and the one requests in flight may still use."""
ATTEMPTS = 3
"""Tries of a request whose connection broke before an answer (sampling again is harmless)."""


class VLLMClient:
    """Client of one vLLM server; ``base_url`` is its OpenAI API root (``http://host:port/v1``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.base_model: str | None = None
        self.model: str | None = None
        self.cache_salt: str | None = None
        """``cache_salt`` of every request after a full-weights update (``prime-policy-vN``):
        vLLM hashes prefix-cache blocks with it, so requests of a new version never reuse KV
        computed under an older one, even where running requests kept the cache from a reset."""
        """The name requests use: the base model, or the newest LoRA adapter."""
        self.adapters: list[str] = []
        self._admin = None
        self._http = None
        self._loop = None

    @property
    def admin(self):
        if self._admin is None:
            from prime_plugin_vllm.admin import VLLMAdmin

            self._admin = VLLMAdmin(self.base_url, timeout=self.timeout, api_key=self.api_key)
        return self._admin

    def health(self) -> bool:
        return self.admin.health()

    # -- sampling -------------------------------------------------------------------------

    def _client(self):
        """The HTTP client of the running event loop (a client is bound to the loop it was
        first used on)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # Idle connections expire before the server drops them (uvicorn: 5 s), so that none
            # is reused at the moment the server closes it.
            self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout,
                                           limits=httpx.Limits(keepalive_expiry=2.0))
            self._loop = loop
        return self._http

    async def _send(self, method: str, path: str, what: str, **kwargs):
        import httpx

        for attempt in range(ATTEMPTS):
            try:
                response = await self._client().request(method, path, **kwargs)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
                if attempt == ATTEMPTS - 1:
                    port = self.base_url.rsplit(":", 1)[-1].split("/")[0]
                    raise PrimeError(f"{what}: the inference server at {self.base_url} is not answering "
                                     f"({type(exc).__name__}: {exc}, {ATTEMPTS} tries): it has stopped",
                                     hint=f"its log says why: output_dir/logs/vllm-{port}.log") from None
                await asyncio.sleep(0.5 * (attempt + 1))
            except httpx.TimeoutException:
                raise PrimeError(f"{what} at {self.base_url}: no answer within {self.timeout:g} s",
                                 hint="raise orchestrator.client.timeout, or lower sampling.max_tokens") from None
        if response.status_code == 401:
            raise PrimeError(f"{what} at {self.base_url}: the server refused the API key (HTTP 401)",
                             hint="give the orchestrator the server's key: orchestrator.client.api_key_var / "
                                  "api_key_file (in `prime run` they follow inference.server's)")
        if response.status_code != 200:
            raise PrimeError(f"{what} at {self.base_url} failed (HTTP {response.status_code}): {response.text[:500]}")
        return response.json()

    async def _base_model(self) -> str:
        if self.base_model is None:
            listed = await self._send("GET", "/models", "listing the served models")
            ids = [m.get("id") for m in listed.get("data", [])]
            bases = [m["id"] for m in listed.get("data", []) if not m.get("parent")]
            if not bases:
                raise PrimeError(f"the vLLM server at {self.base_url} lists no base model (GET /models: {ids})")
            self.base_model = bases[0]
            self.model = self.model or self.base_model
        return self.base_model

    def body(self, request: SampleRequest, model: str) -> dict:
        """The ``/v1/completions`` body of ``request``."""
        body = {"model": model, "prompt": list(request.prompt_ids), "n": request.n,
                "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "logprobs": 0, "return_token_ids": True}
        if request.stop_token_ids:
            body["stop_token_ids"] = list(request.stop_token_ids)
        if request.seed is not None:
            body["seed"] = request.seed
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body

    async def sample(self, request: SampleRequest) -> list[Sample]:
        model = self.model or await self._base_model()
        headers = {"X-Session-ID": request.session_id} if request.session_id else None
        answer = await self._send("POST", "/completions", f"sampling from {model}",
                                  json=self.body(request, model), headers=headers)
        return self.parse(answer)

    def parse(self, answer: dict) -> list[Sample]:
        """The samples of a ``/v1/completions`` answer, in choice order."""
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            return [Sample(token_ids=[int(t) for t in c["token_ids"]],
                           # The first token's logprob is None only for echoed prompts, never here.
                           logprobs=[float(lp) for lp in c["logprobs"]["token_logprobs"]],
                           finish_reason=str(c.get("finish_reason") or ""), text=c.get("text") or "")
                    for c in choices]
        except (KeyError, TypeError, ValueError) as exc:
            raise PrimeError(
                f"unexpected answer from the vLLM server at {self.base_url} ({type(exc).__name__}: {exc}): "
                f"{str(answer)[:300]}",
                hint="prime needs token ids and logprobs in completions (return_token_ids; vLLM >= 0.10.2)",
            ) from None

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Each token's log-probability given those before it: a one-token completion of
        ``token_ids`` with vLLM's ``prompt_logprobs: 0`` (the prompt's own tokens, scored in the
        prefill), at temperature 1. The first token has no context: 0.0."""
        model = self.model or await self._base_model()
        body = {"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        answer = await self._send("POST", "/completions", f"scoring {len(token_ids)} tokens with {model}", json=body)
        return self.parse_prompt_logprobs(answer, token_ids)

    def parse_prompt_logprobs(self, answer: dict, token_ids: list[int]) -> list[float]:
        """``prompt_logprobs`` of a ``/v1/completions`` answer: per position ``None`` (the first)
        or ``{token_id: {"logprob": ...}}``, which holds the prompt's own token (and with
        ``prompt_logprobs: 0`` only that one)."""
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
            if entries is None or len(entries) != len(token_ids):
                raise ValueError(f"{0 if entries is None else len(entries)} prompt logprobs for "
                                 f"{len(token_ids)} tokens")
            out = []
            for position, (entry, token) in enumerate(zip(entries, token_ids, strict=True)):
                if entry is None:
                    if position:
                        raise ValueError(f"no logprob for token {position}")
                    out.append(0.0)
                    continue
                out.append(float(entry[str(token)]["logprob"]))
            return out
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrimeError(
                f"unexpected prompt_logprobs from the vLLM server at {self.base_url} ({type(exc).__name__}: {exc}): "
                f"{str(answer)[:300]}", hint="scoring tokens needs vLLM's prompt_logprobs in completions") from None

    # -- weights --------------------------------------------------------------------------

    async def load_weights(self, step: int, path: str) -> str | None:
        from prime_core.weights import is_adapter
        from prime_plugin_vllm.broadcast import is_broadcast

        if is_broadcast(path):  # the nccl transport: the tensors come from the trainer's group
            await asyncio.to_thread(self.admin.receive_weights, path)
            self.model, self.cache_salt = self.base_model, f"prime-policy-v{step}"
            return None
        if not is_adapter(Path(path)):
            await asyncio.to_thread(self.admin.update_weights, path)
            self.model = self.base_model  # full weights: requests go to the base model again
            self.cache_salt = f"prime-policy-v{step}"
            return None
        name = f"{await self._base_model()}-lora-step-{step}"
        await asyncio.to_thread(self._load_adapter, name, path)
        self.adapters.append(name)
        self.model = name
        while len(self.adapters) > KEEP_ADAPTERS:
            await asyncio.to_thread(self.admin.unload_adapter, self.adapters.pop(0))
        return f"LoRA adapter {name}"

    def _load_adapter(self, name: str, path: str) -> None:
        try:
            self.admin.load_adapter(name, path)
        except PrimeError as exc:
            if "has already been loaded" not in str(exc):
                raise
            # An earlier orchestrator of this run loaded this step already (a resumed run on a
            # server that kept running); its files may have been published again since.
            self.admin.unload_adapter(name)
            self.admin.load_adapter(name, path)

    async def requests_served(self) -> float | None:
        """Completions this server answered since it started: the orchestrator counts requests
        per engine with it when a router in front decides where they go."""
        return await asyncio.to_thread(self.admin.requests_served)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._admin is not None:
            self._admin.close()
            self._admin = None
