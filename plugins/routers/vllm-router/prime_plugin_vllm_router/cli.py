"""``prime vllm-router CONFIG``: the router process of a launch, as a user can type it too.

``CONFIG`` is a resolved inference config with a ``router`` table (``output_dir/configs/
inference.json`` of a ``prime run`` or ``prime inference``). The command waits until every
engine answers ``/health``, then becomes vllm-router (``exec``): same process, so the
launcher's tie to it (SIGTERM when the launcher dies) holds.

Why wait: vllm-router 0.1.17 counts engines by host when it starts ("1 out of 2 unique hosts
are healthy") and starts routing as soon as one engine of a host answers, with the others out
of its rotation until their next health checks pass; every request of the first seconds then
goes to one engine.
"""

from __future__ import annotations

from pathlib import Path

import typer


def vllm_router(config: Path = typer.Argument(..., help="resolved inference config (output_dir/configs/"
                                                         "inference.json) with a router table")) -> None:
    """Run vllm-router in front of the inference replicas of CONFIG ([inference.router])."""
    import os
    import shlex

    from prime_core.cli.common import load_config
    from prime_core.errors import PrimeError
    from prime_plugin_vllm_router.process import command, engine_urls, router_url

    inference = load_config("inference", [str(config)])
    if inference.router is None:
        raise PrimeError(f"{config} has no router table: nothing to route",
                         hint="add [inference.router] to the run's config (router in a `prime inference` config)")
    wait_for_engines(engine_urls(inference), inference.startup_timeout)
    argv = command(inference)
    print(f"vllm-router at {router_url(inference)} in front of {', '.join(engine_urls(inference))} "
          f"(policy {inference.router.policy})\n$ {shlex.join(argv)}", flush=True)
    os.execv(argv[0], argv)


def wait_for_engines(urls: list[str], timeout: float) -> None:
    """Block until ``GET /health`` of every engine answers 200 (``inference.startup_timeout``)."""
    import time

    import httpx

    from prime_core.errors import PrimeError

    deadline = time.monotonic() + timeout
    print(f"waiting for {len(urls)} engine(s) to answer /health", flush=True)
    with httpx.Client(timeout=2.0, trust_env=False) as client:  # loopback: never through a proxy
        for url in urls:
            while True:
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise PrimeError(f"the inference engine at {url} did not answer /health within {timeout:g} s "
                                     "(inference.startup_timeout)", hint="see its log under output_dir/logs/")
                time.sleep(1.0)
