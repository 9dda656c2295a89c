"""An unwritable --out (a read-only file system) is refused by every export in one line, before any work: it failed
at the end with an OSError traceback from the temporary file's clean-up."""

import subprocess
import sys

import pytest
from conftest import ROOT, mounted_tmpfs, recipe_env


@pytest.fixture
def read_only(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "size=64k,ro") as place:
        yield place


@pytest.mark.parametrize("command", [
    ["torchscript", "RUN", "--out", "OUT/emulator.pt"],
    ["torchscript", "RUN", "--out", "OUT/sub/dir/emulator.pt", "--format", "soca"],
    ["aoti", "RUN", "--out", "OUT/emulator.pt2"],
    ["predict", "RUN", "--data", "RUN/in.nc", "--out", "OUT/emulated.nc"],
], ids=["torchscript", "soca-missing-dirs", "aoti", "predict"])
def test_an_unwritable_out_is_one_line_before_any_work(command, read_only, tmp_path):
    # RUN is no run at all: the refusal comes before the run is read
    args = [part.replace("RUN", str(tmp_path / "no-run")).replace("OUT", str(read_only)) for part in command]
    result = subprocess.run([sys.executable, "-m", "toolkit.export", *args], cwd=ROOT, env=recipe_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    out = args[args.index("--out") + 1]
    assert result.stderr.strip().splitlines() == [
        f"error: --out {out}: {read_only} is not writable (a read-only file system or no permission); give a path "
        "you can write to"]
    assert list(read_only.iterdir()) == []
