"""``prime vllm-router CONFIG``: the router process of a launch, as a user can type it too.

``CONFIG`` is a resolved inference config with a ``router`` table (``output_dir/configs/
inference.json`` of a ``prime run`` or ``prime inference``). The command becomes vllm-router
(``exec``): same process, so the launcher's tie to it (SIGTERM when the launcher dies) holds.
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
    argv = command(inference)
    print(f"vllm-router at {router_url(inference)} in front of {', '.join(engine_urls(inference))} "
          f"(policy {inference.router.policy})\n$ {shlex.join(argv)}", flush=True)
    os.execv(argv[0], argv)
