"""The ep strategy on a stand-in MoE model (tests/ep_apply_worker.py): the expert-parallel
output and every gradient match the unsharded model, in 2 gloo processes (one EP group of 2)
and in 4 (two EP groups of 2, whose expert gradients are also summed across the groups)."""

import json
from pathlib import Path

import pytest

from prime_core.testing.ranks import launch

WORKER = Path(__file__).with_name("ep_apply_worker.py")


def run_worker(tmp_path, processes: int, ep: int) -> list[dict]:
    out = tmp_path / f"apply-{processes}-{ep}.json"
    done = launch(processes, str(WORKER), [str(out), str(ep)], timeout=300)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(("processes", "ep"), [(2, 2), (4, 2)], ids=["ep2", "dp2xep2"])
def test_matches_the_unsharded_model(tmp_path, processes, ep):
    results = run_worker(tmp_path, processes, ep)
    assert len(results) == processes
    for rank in results:
        names = rank["errors"]
        assert any(k.startswith("grad:") and "experts" in k for k in names)
        worst = max(names.items(), key=lambda item: item[1])
        assert worst[1] < 2e-6, (rank["rank"], worst)
