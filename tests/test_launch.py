"""`python -m toolkit launch` when workers fail: exit 2 quietly for usage errors (the recipe said it in one line),
one line per failed worker otherwise; never a traceback of its own."""

import os
import re
import subprocess
import sys

import pytest
from conftest import CONFIGS, ROOT, recipe_env, run_recipe

pytestmark = pytest.mark.slow

WORKER = """
import os, signal, sys
rank = int(os.environ["RANK"])
how = sys.argv[1]
if how == "exit2":
    if rank == 0:
        print("error: --something is wrong", file=sys.stderr, flush=True)
    sys.exit(2)
if rank == 0:
    signal.pause()  # still running when rank 1 fails: the agent stops it with SIGTERM, which is not a cause to name
if rank == 1:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "abort":
        os.abort()
"""


def _launch(script, *args):
    return subprocess.run([sys.executable, "-m", "toolkit", "launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
                           "--main_process_port", "0", str(script), *args], cwd=ROOT, env=recipe_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how, expected", [("kill", "signal SIGKILL"), ("abort", "signal SIGABRT")])
def test_a_failed_worker_is_one_line_naming_rank_host_and_signal(how, expected, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = _launch(script, how)
    assert result.returncode == 1, result.stderr
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (local rank 1, pid ") and expected in errors[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_usage_errors_exit_2_with_the_recipes_line_only(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = _launch(script, "exit2")
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and said == ["error: --something is wrong"], result.stderr  # not torchrun's two


def test_a_recipe_flag_error_under_two_processes_is_one_line(tmp_path):
    out = tmp_path / "run"
    result = _launch(ROOT / "recipes" / "sasrec.py", "--batch-size", "63", "--log-with", "none", "--output-dir",
                     str(out))
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and errors[0].startswith("error: --batch-size 63 is not divisible by the 2 processes")
    assert "Traceback" not in result.stdout + result.stderr
    assert not out.exists()


WRITER = """import sys
from toolkit.console import write_line as say
for _ in range(2000):
    say(f"[rank {sys.argv[1]}] " + "x" * 300)
"""


def test_lines_of_processes_sharing_a_pipe_never_interleave():
    """Four processes write long lines into one pipe, as ranks do under a launcher (PYTHONUNBUFFERED=1: print() then
    writes the text and its newline in two calls, and the [rank N] lines were seen merged). Every line arrives whole."""
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(rank)], stderr=write_end, cwd=ROOT, env=env)
             for rank in range(4)]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    whole = re.compile(r"^\[rank [0-3]\] x{300}$")
    broken = [line for line in lines if not whole.match(line)]
    assert len(lines) == 8000 and broken == [], broken[:3]


@pytest.mark.parametrize("recipe", ["sasrec", "dcrnn", "ufs_emulator", "hrm"])
def test_a_recipe_is_a_plain_script_of_the_installed_package_from_any_directory(recipe, tmp_path):
    # No sys.path edits in the recipes: `toolkit` comes from the installed project, so the script runs from
    # anywhere (here a directory holding nothing of the checkout) and writes nothing there for --help.
    script = (ROOT / "recipes" / f"{recipe}.py").read_text()
    assert "sys.path" not in script and "E402" not in script
    result = run_recipe(["--help"], recipe=recipe, cwd=tmp_path)
    assert result.returncode == 0 and "--output-dir" in result.stdout and "--batch-per-process" in result.stdout
    assert list(tmp_path.iterdir()) == []
