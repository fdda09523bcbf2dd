"""The torch EP backend meets the contract in 2 and 4 gloo processes, over the whole world and
over EP groups of 2 consecutive ranks inside 4 processes."""

from prime_plugin_ep.contract import TOLERANCE, run_in_processes


def _worst(results, label):
    return max(value for rank in results for errors in rank[label].values() for value in errors.values())


def test_two_processes(tmp_path):
    results = run_in_processes("torch", 2, tmp_path)
    assert len(results) == 2
    assert _worst(results, "world") < TOLERANCE["float32"]


def test_four_processes_and_groups_of_two(tmp_path):
    results = run_in_processes("torch", 4, tmp_path, ep=2)
    assert len(results) == 4
    assert _worst(results, "world") < TOLERANCE["float32"]
    assert _worst(results, "ep2") < TOLERANCE["float32"]


def test_bfloat16_in_two_processes(tmp_path):
    results = run_in_processes("torch", 2, tmp_path, dtype="bfloat16")
    assert _worst(results, "world") < TOLERANCE["bfloat16"]
