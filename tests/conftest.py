"""Shared helpers: run a recipe as real processes (plain python or `accelerate launch`) with tiny settings."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from xdist_groups import pytest_collection_modifyitems  # noqa: F401 (a hook: pytest finds it in conftest)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "accelerate_configs"
DATA_CACHE = ROOT / ".cache" / "test-data"  # MovieLens-100K fetched and prepared once, shared by all tests

# Small enough to train a few steps in seconds on 2 cores, big enough to exercise every code path.
TINY = ["--hidden", "16", "--blocks", "1", "--maxlen", "20", "--batch-size", "64", "--eval-every", "1",
        "--log-with", "none", "--cache-dir", str(DATA_CACHE)]


# The machine's load as a run sees it during training (toolkit.loop.restart.LoadWatch): idle, whatever the other test
# worker does, so that no test run restarts itself under PASSIVE unless the test asks for it (TOOLKIT_LOAD_FILE).
IDLE_LOAD = Path(tempfile.gettempdir()) / f"toolkit-tests-idle-loadavg-{os.getpid()}"
IDLE_LOAD.write_text("0.00 0.00 0.00 1/100 1\n")
atexit.register(IDLE_LOAD.unlink, missing_ok=True)


def recipe_env(extra: dict | None = None) -> dict:
    # OMP_WAIT_POLICY, GOMP_SPINCOUNT: this test process imported toolkit, which sets one; a recipe starts as from a
    # user's shell.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "ACCELERATE_", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))}
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "TOOLKIT_LOAD_FILE": str(IDLE_LOAD)})
    env.update(extra or {})
    return env


def run_recipe(args: list[str], *, config: str | None = None, recipe: str = "sasrec", cwd: Path | None = None,
               env: dict | None = None, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run recipes/<recipe>.py (or the script `recipe` when it ends in .py): plain python when config is None, else
    through `accelerate launch`."""
    script = recipe_script(recipe)
    if config is None:
        command = [sys.executable, script, *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                   "--main_process_port", "0", script, *args]
    result = subprocess.run(command, cwd=cwd or ROOT, env=recipe_env(env), capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
                             f"\n--- stderr\n{result.stderr[-6000:]}")
    return result


TOY = str(ROOT / "tests" / "toy_recipe.py")  # the toolkit API's test recipe


def recipe_script(recipe: str) -> str:
    return recipe if recipe.endswith(".py") else str(ROOT / "recipes" / f"{recipe}.py")


def load_recipe(recipe: str, module_name: str):
    """recipes/<recipe>.py (or a script path) imported as the module `module_name`, its main() not run; registered in
    sys.modules, where its dataclasses look their module up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, recipe_script(recipe))
    module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def ranks_seen(output: str) -> set[tuple[int, int]]:
    """(rank, world size) pairs the processes announced from inside (lines that start "[rank r/w]")."""
    import re

    return {(int(r), int(w)) for r, w in re.findall(r"^\[rank (\d+)/(\d+)\](?: |$)", output, re.MULTILINE)}


def logged_steps(run_dir: Path) -> int:
    """The newest step whose training loss reached log.csv (--log-with csv --log-every 1): 0 before any."""
    import csv

    path = Path(run_dir) / "log.csv"
    if not path.exists():
        return 0
    rows = list(csv.DictReader(open(path)))
    return max((int(r["step"]) for r in rows if r["name"] == "train/loss" and r["step"]), default=0)


def logged_losses(run_dir: Path) -> dict[int, float]:
    """{step: training loss} from log.csv (--log-with csv --log-every 1)."""
    import csv

    rows = csv.DictReader(open(Path(run_dir) / "log.csv"))
    return {int(r["step"]): float(r["value"]) for r in rows if r["name"] == "train/loss"}


def dir_tree(root: Path) -> list[tuple[str, int]]:
    """Every path under root with its size (-1 for a directory): equal before and after = nothing written."""
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*"))


_SERVERS: dict[str, subprocess.Popen] = {}  # recipe -> its tests/recipe_server.py process (this xdist worker's)


def _stop_servers() -> None:
    for server in _SERVERS.values():
        server.kill()
        server.wait()


atexit.register(_stop_servers)


def run_preloaded(args: list[str], *, recipe: str = "sasrec", cwd: Path, timeout: float = 300
                  ) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py ARGS` from cwd, as a child forked from a server that has the recipe's imports
    loaded (tests/recipe_server.py): the same script and exit status in milliseconds, for the many bad-input cases."""
    import select
    import tempfile

    server = _SERVERS.get(recipe)
    if server is None or server.poll() is not None:
        server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "recipe_server.py"), recipe_script(recipe)],
                                  cwd=ROOT, env=recipe_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _SERVERS[recipe] = server
    with tempfile.TemporaryDirectory() as scratch:  # outside cwd: a case's directory must stay as it was
        out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
        server.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}) + "\n")
        server.stdin.flush()
        if not select.select([server.stdout], [], [], timeout)[0]:
            server.kill()
            raise AssertionError(f"{recipe} {' '.join(args)} did not end within {timeout} s")
        status = json.loads(server.stdout.readline())["status"]
        return subprocess.CompletedProcess([recipe_script(recipe), *args], status, out.read_text(), err.read_text())


def assert_refused(args: list[str], fragments, *, recipe: str = "sasrec", case_dir: Path) -> str:
    """Run the recipe (as `python SCRIPT ARGS` from case_dir, forked from a preloaded server) on a bad input: exit 2,
    exactly one `error:` line on stderr holding every fragment, no traceback, and nothing under case_dir created or
    changed. Returns the error line."""
    before = dir_tree(case_dir)
    result = run_preloaded(args, recipe=recipe, cwd=case_dir)
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, output
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in output
    assert not any(line.startswith("error:") for line in result.stdout.splitlines())
    assert dir_tree(case_dir) == before  # nothing created, nothing changed
    return errors[0]


def one_and_two_process_runs(args: list[str], *, recipe: str, root: Path) -> dict[str | None, Path]:
    """The same run with 1 process (plain python) and with 2 gloo processes, under root:
    {None: run dir, "cpu_2proc.yaml": run dir}."""
    runs = {}
    for config in (None, "cpu_2proc.yaml"):
        runs[config] = root / str(config)
        run_recipe([*args, "--output-dir", str(runs[config])], recipe=recipe, config=config)
    return runs


DCRNN_SYNTH = DATA_CACHE / "dcrnn-synth-10x5"  # 10 sensors, 5 days: 985/121/265 windows (odd counts: padded batches)


@pytest.fixture(scope="session")
def synth_data():
    """The DCRNN tests' generated road network, written once (atomically, under a lock: parallel pytest processes
    share it)."""
    from filelock import FileLock

    from toolkit.data.traffic import generate, write_dataset

    DATA_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DATA_CACHE / ".dcrnn-synth.lock")):
        if not (DCRNN_SYNTH / "adj_mx.pkl").exists():
            partial = DCRNN_SYNTH.with_name(DCRNN_SYNTH.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            write_dataset(partial, *generate(sensors=10, days=5, seed=0, progress=False))
            os.replace(partial, DCRNN_SYNTH)
    return DCRNN_SYNTH


@pytest.fixture(scope="session")
def movielens_cache() -> Path:
    """Fetch and prepare MovieLens-100K once (the recbole wheel from PyPI when GroupLens is unreachable)."""
    from filelock import FileLock

    from toolkit.data.movielens import prepare_movielens

    DATA_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DATA_CACHE / ".prepare.lock")):  # pytest-xdist workers share the cache
        prepare_movielens("ml-100k", None, DATA_CACHE)
    return DATA_CACHE


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+): a port picked from that range can be taken by
    any outgoing connection (gloo opens many) before the launcher binds it."""
    import random
    import socket

    for _ in range(100):
        port = random.randint(24000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 24000-32000")


def start_machines(args: list[str], *, config: str, machines: int = 2, recipe: str = "sasrec",
                   env: dict | None = None, cwds: list[Path] | None = None) -> list[subprocess.Popen]:
    """Start one `accelerate launch` per "machine" on this host (machine_rank 0..machines-1, 127.0.0.1), as
    one would on each node of a cluster; they rendezvous into one process group. cwds: each machine's working
    directory (different ones make a relative --output-dir a different directory per machine: local disks)."""
    port = str(free_port())
    script = recipe_script(recipe)
    procs = []
    for rank in range(machines):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                   "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                   script, *args]
        procs.append(subprocess.Popen(command, cwd=cwds[rank] if cwds else ROOT, env=recipe_env(env),
                                      stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def launch_machines(args: list[str], *, config: str, machines: int = 2, recipe: str = "sasrec",
                    timeout: float = 600, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """start_machines, then wait for all of them; fails with their output if any exits non-zero."""
    procs = start_machines(args, config=config, machines=machines, recipe=recipe, env=env)
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    for result in results:
        if result.returncode != 0:
            raise AssertionError(f"machine exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
                                 f"\n--- stderr\n{result.stderr[-5000:]}")
    return results


# ---- the local SLURM cluster (slurm/local_cluster.sh), shared by every xdist worker --------------------------

CLUSTER_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/toolkit-slurm"))
USERS = CLUSTER_DIR / "pytest-users.json"


def cluster(action: str) -> subprocess.CompletedProcess:
    # start may install packages first: minutes on a slow mirror.
    script = str(ROOT / "slurm" / "local_cluster.sh")
    return subprocess.run(["bash", script, action], capture_output=True, text=True, timeout=900)


def catches(pid: int, signum: int) -> bool:
    """Whether process pid has a handler for signum: the kernel's caught-signals mask (/proc/PID/status, SigCgt).
    Polled before a signal meant for start-up, since a loaded machine can take any time to get there."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


@contextmanager
def users_locked():
    """The pytest processes using the cluster now, read and rewritten under a lock: xdist workers share one
    cluster, so the last one out stops it (`--dist loadgroup` does not keep the group on one worker under
    pytest 9.2 with xdist 3.8: pytest-xdist #1386)."""
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    with open(CLUSTER_DIR / "pytest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(USERS.read_text()) if USERS.exists() else {"users": [], "owned": False}
        state["users"] = [pid for pid in state["users"] if pid != os.getpid() and alive(pid)]
        yield state
        USERS.write_text(json.dumps(state))


@pytest.fixture(scope="session")
def slurm_env() -> dict:
    with users_locked() as state:
        if not state["users"]:
            # A cluster that was up before the tests (started by hand) is left running afterwards.
            state["owned"] = cluster("status").returncode != 0
        started = cluster("start")
        if started.returncode == 2:
            pytest.skip(started.stderr.strip().splitlines()[-1])
        assert started.returncode == 0, f"local_cluster.sh start failed\n{started.stdout}\n{started.stderr}"
        state["users"].append(os.getpid())
    yield {**os.environ, "SLURM_CONF": str(CLUSTER_DIR / "slurm.conf")}
    with users_locked() as state:
        if not state["users"] and state["owned"]:
            cluster("stop")


def sbatch_cpu_run(slurm_env: dict, recipe_args: list[str], tmp_path: Path) -> Path:
    """Submit slurm/multinode_cpu.sbatch with the recipe and its flags to the local cluster (from the project root,
    as users do), wait for it, and check what every recipe's 2-node run must show: exit 0, `verify` passes with
    world size 2 over gloo, and both ranks announced themselves from two nodes. Returns the run directory."""
    from toolkit.tools.verify import verify_run

    run_dir, log = tmp_path / "run", tmp_path / "batch.out"
    command = ["sbatch", "--parsable", f"--output={log}", "--wait", "slurm/multinode_cpu.sbatch", *recipe_args]
    env = recipe_env({"SLURM_CONF": slurm_env["SLURM_CONF"], "RUN_DIR": str(run_dir)})
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr + (log.read_text() if log.exists() else "")
    assert verify_run(run_dir, expect_world_size=2, expect_backend="gloo") == []
    seen = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert "[rank 0/2]" in seen and "[rank 1/2]" in seen and "node_rank=1" in seen
    return run_dir


@contextmanager
def mounted_tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` (made) with mount's -o `options` (size=400k, ro, ...), unmounted after; the test
    skips, saying why, where mounting is not allowed (root needed)."""
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {result.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
