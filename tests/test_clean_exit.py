"""Every process of a run exits clean: exit status 0 (or the run's own error status) on every rank, never
`terminate called without an active exception` (SIGABRT at interpreter exit, which fails the launcher and marks a
SLURM job FAILED after a successful run).

Two kinds of evidence: each recipe's 2-process tiny run exits 0 (RUNS_IN_A_ROW times); and every
process reports, as its last act (TOOLKIT_EXIT_REPORT=1, toolkit.process.shutdown), the threads still alive, which
must hold
none of gloo's threads and none of the toolkit's (the heartbeat, the launcher watch). The second catches a regression
at once, where the abort itself is a race seen in about 1 run of 10. Runs that stop early (request_stop, a
non-finite loss, pre-emption) are checked per rank: each rank is its own machine (launcher), so each rank's own exit
status is seen, not one the agent imposed after another rank ended.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import (
    CONFIGS,
    DATA_CACHE,
    ROOT,
    TINY,
    TOY,
    free_port,
    logged_steps,
    ranks_seen,
    recipe_env,
    run_recipe,
)

from toolkit.process.shutdown import EXIT_REPORT

pytestmark = pytest.mark.slow

REPORT = {EXIT_REPORT: "1"}
RUNS_IN_A_ROW = 1  # the exit report below catches a regression in one run, where the abort is 1 in 10
# Threads that must never be alive when a process exits (toolkit.process.shutdown says why each matters).
MUST_END = ("gloo", "toolkit-", "pt_")


def exit_reports(stderr: str) -> dict[int, list[str]]:
    """{rank: names of the threads alive at exit} from each process's TOOLKIT_EXIT_REPORT line."""
    reports = {}
    for rank, names in re.findall(r"^\[rank (\d+)\] threads at exit: \d+ \((.*)\)$", stderr, re.MULTILINE):
        reports[int(rank)] = [] if names == "none" else names.split(", ")
    return reports


def assert_exited_clean(stderr: str, ranks: set[int]) -> None:
    assert "terminate called" not in stderr, stderr[-3000:]
    reports = exit_reports(stderr)
    assert set(reports) == ranks, stderr[-3000:]  # every rank got to its last act
    for rank, names in reports.items():
        assert not [n for n in names if n.startswith(MUST_END)], (rank, names)


@pytest.fixture(scope="module")
def ufs_grid(tmp_path_factory):
    from toolkit.data.ufs import synthesize

    return synthesize(tmp_path_factory.mktemp("ufs") / "grid.nc", seed=7, nlat=24, nlon=48)


def tiny_args(recipe: str, request) -> list[str]:
    """Two optimizer steps of each recipe on its tiny data, evaluated once: every part of a run, in seconds."""
    common = ["--max-steps", "2", "--log-with", "none"]
    if recipe == "sasrec":
        request.getfixturevalue("movielens_cache")
        return [*TINY, *common]
    if recipe == "dcrnn":
        data = request.getfixturevalue("synth_data")
        return ["--data", str(data), "--cache-dir", str(DATA_CACHE), "--units", "8", "--batch-size", "32",
                "--threads", "1", *common]
    if recipe == "ufs_emulator":
        return ["--data", str(request.getfixturevalue("ufs_grid")), "--batch-size", "40", *common]
    return ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "48", "--aug", "1", "--val-puzzles", "16",
            "--test-puzzles", "16", "--max-blanks", "8", "--hidden", "16", "--heads", "2", "--expansion", "2",
            "--batch-size", "16", "--halt-max-steps", "2", "--threads", "1", *common]


@pytest.mark.parametrize("recipe", ["sasrec", "dcrnn", "ufs_emulator", "hrm"])
def test_every_recipe_exits_clean_and_its_threads_are_gone(recipe, request, tmp_path):
    args = tiny_args(recipe, request)
    for attempt in range(RUNS_IN_A_ROW):
        out = tmp_path / f"run{attempt}"
        result = run_recipe([*args, "--output-dir", str(out)], recipe=recipe, config="cpu_2proc.yaml", check=False,
                            env=REPORT)
        assert result.returncode == 0, f"run {attempt}: exit {result.returncode}\n{result.stderr[-4000:]}"
        assert ranks_seen(result.stderr) == {(0, 2), (1, 2)}
        assert (out / "summary.json").exists()
        assert_exited_clean(result.stderr, {0, 1})


def start_ranks(args: list[str], tmp_path) -> list[subprocess.Popen]:
    """The toy recipe as 2 one-process machines, each under its own `python -m toolkit launch`: each launcher's
    exit status is its rank's (0, or 2 for a usage error; 1 and a line naming the signal for an abort)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        command = [sys.executable, "-m", "toolkit", "launch", "--config_file", str(CONFIGS / "2node_cpu.yaml"),
                   "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                   TOY, *args, "--output-dir", str(tmp_path / "run")]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=recipe_env(REPORT), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each launcher, once all have ended."""
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs, strict=True)]


@pytest.mark.parametrize("how, args, status", [
    ("request_stop", ["--patience", "1", "--min-delta", "100", "--eval-every-steps", "2"], 0),
    ("non-finite loss", ["--diverge-at-step", "3"], 1),  # a runtime failure: exit 1 (2 is for bad input)
], ids=["request_stop", "non-finite-loss"])
def test_a_run_that_stops_early_exits_clean_on_every_rank(how, args, status, tmp_path):
    procs = start_ranks(["--max-steps", "12", "--log-with", "none", *args], tmp_path)
    ended = finish(procs)
    for rank, (code, _stdout, stderr) in enumerate(ended):
        assert code == status, f"rank {rank} ({how}): exit {code}\n{stderr[-3000:]}"
        assert ranks_seen(stderr) == {(rank, 2)}
        assert_exited_clean(stderr, {rank})
    if how == "request_stop":
        assert "stopping at step 4" in ended[0][1] + ended[0][2]
    else:
        assert "the training loss is nan at step 3" in ended[0][2]


def test_a_pre_empted_run_exits_clean_on_every_rank(tmp_path):
    procs = start_ranks(["--epochs", "200", "--max-steps", "2000", "--log-with", "csv", "--log-every", "1"],
                        tmp_path)
    deadline = time.monotonic() + 300
    while logged_steps(tmp_path / "run") < 3 and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition (steps logged), not a timed wait
    worker = [c for c in psutil.Process(procs[1].pid).children(recursive=True) if "toy_recipe.py" in " ".join(
        c.cmdline())]
    assert len(worker) == 1, [c.cmdline() for c in psutil.Process(procs[1].pid).children(recursive=True)]
    worker[0].send_signal(signal.SIGUSR1)  # rank 1 only: every rank agrees at the next step
    ended = finish(procs)
    for rank, (code, _stdout, stderr) in enumerate(ended):
        assert code == 0, f"rank {rank}: exit {code}\n{stderr[-3000:]}"
        assert_exited_clean(stderr, {rank})
    assert re.search(r"pre-empted at step \d+: checkpoint saved", ended[0][1] + ended[0][2])


DDP_SCRIPT = """
import gc, json, sys
from toolkit.process import begin_process
begin_process()
import torch
from accelerate import Accelerator
from toolkit.process import shutdown

shutdown.before_process_group()
accelerator = Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()  # a step through DDP's Reducer
gathered = accelerator.gather(torch.tensor([accelerator.process_index]))  # its tensors stay alive in Python
before = [t for t in shutdown.live_threads() if t.startswith("pt_gloo")]
shutdown.end_process_group(accelerator)  # while the DDP model is still referenced, as in a recipe's main()
kept = sorted(k for k in ("reducer", "logger", "process_group") if k in model.__dict__)
ddp, world, rank = type(model).__name__, accelerator.num_processes, accelerator.process_index
del model
accelerator.free_memory()
gc.collect()  # the model is freed here: only the group's Python object, which frees it without the GIL, is left
after = [t for t in shutdown.live_threads() if t.startswith(("gloo", "pt_gloo"))]
json.dump({"world": world, "ddp": ddp, "before": before, "kept": kept, "after": after, "gathered": gathered.tolist()},
          open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


def test_the_group_ends_while_a_ddp_model_is_still_alive(tmp_path):
    """The mechanism of the hang seen once in 40 runs, checked every time: when the group ends, the DDP model must
    no longer hold it through its Reducer (freed holding the GIL, which a gloo thread finishing the last collective
    may need: a deadlock), only through the group's own Python object (freed with the GIL released)."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    run_recipe([str(tmp_path)], config="cpu_2proc.yaml", recipe=str(script), timeout=300)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["world"], seen["ddp"], seen["gathered"]) == (2, "DistributedDataParallel", [0, 1])
        assert len(seen["before"]) == 2 and seen["kept"] == ["process_group"] and seen["after"] == [], seen
