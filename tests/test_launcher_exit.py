"""The one line that replaces torch's SignalException traceback in `accelerate launch` and `torchrun`: installed by
the project's .pth in those launchers' processes only (the signal itself is tested end to end in test_sigterm.py)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

from toolkit.process.launcher_exit import launcher_name

PTH = "accelerate_recipes_launcher.pth"


@pytest.mark.parametrize("argv, name", [
    (["/v/bin/python", "/v/bin/accelerate", "launch", "--config_file", "c.yaml", "r.py"], "accelerate launch"),
    (["python", "-m", "accelerate.commands.launch", "r.py"], "accelerate launch"),
    (["python", "/v/bin/torchrun", "--nproc-per-node", "2", "r.py"], "torchrun"),
    (["python", "-m", "torch.distributed.run", "r.py"], "torchrun"),
    (["python", "/v/bin/accelerate", "config"], None),  # another accelerate command
    (["python", "-m", "toolkit", "launch", "r.py"], None),  # says its own line (toolkit.tools.launch)
    (["python", "recipes/sasrec.py"], None),
    (["python", "-c", "import accelerate"], None),
    (["python"], None),
    ([], None),
])
def test_only_the_launchers_are_recognised(argv, name):
    assert launcher_name(argv) == name


def test_the_pth_is_installed_and_changes_nothing_in_any_other_process():
    assert (Path(sysconfig.get_paths()["purelib"]) / PTH).read_text() == (ROOT / PTH).read_text()
    probe = "import sys; print(sys.excepthook is sys.__excepthook__, 'toolkit' in ' '.join(sys.modules))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.split() == ["True", "False"]


def test_a_wheel_of_the_project_carries_the_pth(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("accelerate_recipes-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(PTH).decode() == (ROOT / PTH).read_text()


def test_in_a_launcher_the_signal_exception_is_one_line_and_other_errors_keep_their_traceback(tmp_path):
    """The hook as the .pth installs it, in a process that raises what torchrun's agent raises on SIGTERM."""
    script = tmp_path / "raise_it.py"
    script.write_text("""import signal, sys
from toolkit.process.launcher_exit import quiet_signal_exit
quiet_signal_exit("accelerate launch")
from torch.distributed.elastic.multiprocessing.api import SignalException
if sys.argv[1] == "signal":
    raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
raise ValueError("something else")
""")
    signalled = subprocess.run([sys.executable, str(script), "signal"], capture_output=True, text=True, cwd=ROOT)
    assert signalled.returncode == 1
    assert signalled.stderr.strip().splitlines() == [
        "accelerate launch: stopped by SIGTERM, sent on to the workers: they checkpoint at their next step "
        "(continue with --resume-from auto)"]
    other = subprocess.run([sys.executable, str(script), "other"], capture_output=True, text=True, cwd=ROOT)
    assert other.returncode == 1 and "Traceback" in other.stderr and "ValueError: something else" in other.stderr
