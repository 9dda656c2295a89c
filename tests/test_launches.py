"""benchmarks/launches.py on the UFS MLP: the whole step's kernels, and with --outside-step only what a --cuda-graphs
run still launches around each replay (the batch's cut), far fewer; hrm, whose step is not loop.run_step's, refused
in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "launches.py"


def kernels(*flags: str) -> float:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--recipe", "ufs_emulator", "--warmup", "2", "--steps", "4", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"syncs/step = [\d.]+", lines[-2])
    return float(re.fullmatch(r"kernels/step = ([\d.]+)", lines[-1]).group(1))


def test_outside_the_step_counts_the_batch_cut_alone():
    whole, outside = kernels(), kernels("--outside-step")
    assert whole > 20 and 1 <= outside <= 5  # the step's forward, backward and Adam (29) against the cut (3)


def test_outside_the_step_of_hrm_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--recipe", "hrm", "--outside-step"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].endswith("give ufs_emulator, sasrec or dcrnn")
