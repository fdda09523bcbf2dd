"""``prime eval CONFIG``: one evaluation of a model folder (served for the duration) or of
running servers, written to ``output_dir/eval/results.json`` (the metrics: ``eval``)."""

from __future__ import annotations

import asyncio


def run_standalone(config) -> int:
    """``prime eval CONFIG``: evaluate ``model.name`` (a server started from ``[inference]``
    for the duration) or the running server(s) at ``orchestrator.client.base_url`` (with
    ``inference = false``), and write ``output_dir/eval/results.json``."""
    import json

    from prime_core.errors import ConfigError
    from prime_core.orchestrator.config import EvalConfig
    from prime_core.orchestrator.role import Orchestrator
    from prime_core.run_dir import atomic_write_text

    orch = config.orchestrator
    settings = orch.eval or EvalConfig()
    envs = settings.env or orch.env
    if not envs:
        raise ConfigError(["orchestrator.eval.env: nothing to evaluate; add [[orchestrator.eval.env]] (or "
                           "[[orchestrator.env]]) with an environment `prime plugins list` shows"])
    orch = orch.model_copy(update={"env": envs, "eval": settings.model_copy(update={"env": []})})
    if config.inference is not None:
        _one_server(config.inference)
    out = orch.output_dir / "eval" / "results.json"
    served = config.inference.model.name if config.inference is not None else ", ".join(orch.client.base_url)
    if getattr(config, "dry_run", False):
        how = "the running server(s)"
        if config.inference is not None:
            from prime_core.inference.backend import describe, select_backend

            name = config.inference.backend
            how = f"a {describe(select_backend(name, key='inference.backend'), name)} server it starts"
        names = ", ".join(getattr(env, "name", None) or env.id for env in envs)
        print(f"dry run: would evaluate {served} through {how} on {names}: {settings.num_examples} examples, "
              f"{settings.rollouts_per_example} rollouts each; results to {out}", flush=True)
        return 0
    server = _start_server(config.inference) if config.inference is not None else None
    try:
        orchestrator = Orchestrator(orch)
        orchestrator.wait_healthy()
        results = asyncio.run(orchestrator.evaluate_once())
    finally:
        if server is not None:
            server.stop()
    record = {"model": str(served), "num_examples": settings.num_examples, "k": settings.rollouts_per_example,
              "seed": settings.seed, "time": results.pop("time"), "environments": results}
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    for name, metrics in results.items():
        shown = ", ".join(f"{key} {value:.3f}" for key, value in metrics.items() if "@" in key)
        print(f"{name}: {shown} ({metrics['env_errors']} env errors)", flush=True)
    print(f"results: {out}", flush=True)
    return 0


def _one_server(inference) -> None:
    from prime_core.errors import PrimeError

    if inference.parallel.dp > 1:
        raise PrimeError(f"inference.parallel.dp = {inference.parallel.dp}: prime eval starts one server",
                         hint="set --inference.parallel.dp 1, or start the servers yourself and pass "
                              "--no-inference --orchestrator.client.base-url URL ...")


def _start_server(inference):
    from prime_core.inference.backend import select_backend

    server = select_backend(inference.backend, key="inference.backend").server(inference)
    print(f"starting the inference server for {inference.model.name}", flush=True)
    server.start()
    try:
        server.wait_healthy(inference.startup_timeout)
    except BaseException:
        server.stop()
        raise
    return server
