"""Two "machines" on this host (two `accelerate launch`, machine_rank 0 and 1) form ONE gloo run whose result
matches a one-process run with the same global batch."""

import re

import pytest
from conftest import final_weights, launch_machines, logged_losses, run_recipe
from test_exactness import EQUIV

pytestmark = pytest.mark.slow


def _node_ranks(stderr: str) -> set[tuple[int, int]]:
    return {(int(m[0]), int(m[1])) for m in re.findall(r"\[rank (\d)/2\] .*node_rank=(\d)", stderr)}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_machines_match_one_process(optimizer, tmp_path, movielens_cache):
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*EQUIV, "--optimizer", optimizer] + (["--lr", "0.5"] if optimizer == "sgd" else [])
    run_recipe([*args, "--output-dir", str(one)])
    machines = launch_machines([*args, "--output-dir", str(two)], config="2node_cpu.yaml")
    # seen from inside: rank 0 runs on machine 0 and rank 1 on machine 1, world size 2
    assert _node_ranks(machines[0].stderr) == {(0, 0)} and _node_ranks(machines[1].stderr) == {(1, 1)}
    if optimizer == "sgd":
        w1, w2 = final_weights(one, 20), final_weights(two, 20)
        assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    else:
        l1, l2 = logged_losses(one), logged_losses(two)
        assert sorted(l1) == sorted(l2) == list(range(1, 21))
        assert max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1) < 1e-4
