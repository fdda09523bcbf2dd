"""Configs the transformers backend cannot serve, refused at load time (``prime config validate``,
``prime run``) with the key and the way out: what vLLM has and this backend lacks."""

from __future__ import annotations

NAME = "transformers"


def _uses_us(name: str, key: str) -> bool:
    """Whether the backend setting ``name`` (at ``key``) selects this backend here."""
    if name == NAME:
        return True
    if name != "auto":
        return False
    from prime_core.errors import PrimeError
    from prime_core.inference.backend import select_backend

    try:
        return select_backend(name, key=key).name == NAME
    except PrimeError:  # no backend can run here: the core reports that itself
        return False


def inference_problems(inference, prefix: str) -> list[str]:
    problems = []
    if inference.lora is not None:
        problems.append(f"{prefix}lora: the transformers backend serves full weights only, not LoRA adapters "
                        "(trainer.model.lora needs inference.backend = 'vllm')")
    if inference.parallel.tp > 1:
        problems.append(f"{prefix}parallel.tp = {inference.parallel.tp}: the transformers backend has no tensor "
                        "parallelism (one replica is one device); use parallel.dp replicas, or the vllm backend")
    if inference.args:
        from prime_plugin_transformers.cb_config import args_problems, cb_fields

        problems += [p.replace("inference.", prefix, 1) for p in args_problems(inference.args, cb_fields())]
    return problems


def orchestrator_problems(orchestrator, prefix: str) -> list[str]:
    if orchestrator.sampling.seed is None:
        return []
    return [f"{prefix}sampling.seed = {orchestrator.sampling.seed}: the transformers backend has no per-request "
            "seeds, so the samples would not be reproducible; unset it, or use inference.backend = 'vllm'"]


def ipc_problems(config) -> list[str]:
    """``weight_broadcast.type = 'ipc'`` (this plugin's transport) in an ``rl`` config: inference
    on the trainer's machine, on a GPU it shares with the trainer (the core checks the backend:
    ``WeightTransport.backends``)."""
    wb = config.orchestrator.weight_broadcast
    if wb is None or wb.type != "ipc":
        return []
    found, way_out = [], "or use weight_broadcast.type = 'filesystem'"
    deployment = config.deployment
    if deployment.type != "single_node":
        found.append(f"weight_broadcast.type = 'ipc' shares memory on one machine; deployment.type is "
                     f"{deployment.type!r}: {way_out}")
    elif deployment.inference_gpu_ids and deployment.trainer_gpu_ids and \
            not set(deployment.inference_gpu_ids) & set(deployment.trainer_gpu_ids):
        found.append(f"weight_broadcast.type = 'ipc' needs the trainer's GPU visible to inference; "
                     f"deployment.trainer_gpu_ids = {list(deployment.trainer_gpu_ids)} and inference_gpu_ids = "
                     f"{list(deployment.inference_gpu_ids)} share none: name one GPU for both, {way_out}")
    return found


def problems(config, root: str) -> list[str]:
    found = []
    if root == "rl":
        found += ipc_problems(config)
        # no [inference] section: the run uses servers started elsewhere (--no-inference)
        if config.inference is not None and _uses_us(config.inference.backend, "inference.backend"):
            found += inference_problems(config.inference, "inference.")
        if _uses_us(config.orchestrator.client.backend, "orchestrator.client.backend"):
            found += orchestrator_problems(config.orchestrator, "orchestrator.")
    elif root == "inference" and _uses_us(config.backend, "backend"):
        found += inference_problems(config, "")
    elif root == "orchestrator" and _uses_us(config.client.backend, "client.backend"):
        found += orchestrator_problems(config, "")
    return found
