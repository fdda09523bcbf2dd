"""Run under torchrun: ``deepep_fake_worker.py OUT.json``. The deepep dispatcher, over the
CPU stand-in for ``deep_ep`` (fake_deep_ep.py), against the EP contract: whole batches and
batches cut into chunks of 3 tokens (the idle-rank scenario sends padded empty chunks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import fake_deep_ep

sys.modules["deep_ep"] = fake_deep_ep


def main(path: Path) -> int:
    import torch.distributed as dist

    from prime_core import distributed
    from prime_plugin_deepep.dispatch import make
    from prime_plugin_ep.contract import check_backend

    world = distributed.init()
    configs = {"whole": SimpleNamespace(deepep_num_sms=24, deepep_token_chunk_size=None),
               "chunked": SimpleNamespace(deepep_num_sms=None, deepep_token_chunk_size=3)}
    results, failures = {}, []
    for label, config in configs.items():
        try:
            results[label] = check_backend("deepep", make=make, config=config, dtype="bfloat16")
        except AssertionError as exc:
            failures.append(f"rank {world.rank}, {label}: {exc}")
    results["calls"] = dict(fake_deep_ep.calls)
    everyone = [None] * world.size
    dist.all_gather_object(everyone, {"results": results, "failures": failures})
    if world.main:
        path.write_text(json.dumps(everyone, indent=1))
    distributed.shutdown()
    return 1 if any(r["failures"] for r in everyone) else 0


if __name__ == "__main__":
    from prime_core.distributed import exit_process

    exit_process(main(Path(sys.argv[1])))
