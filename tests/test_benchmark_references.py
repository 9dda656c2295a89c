"""The reference benchmarks fetch nothing: without a checkout of the reference they say in one line where to get it
and exit 2, before any data is prepared or anything is trained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = {"sasrec.py": "pmixer/SASRec.pytorch", "dcrnn.py": "chnsh/DCRNN_PyTorch", "hrm.py": "sapientinc/HRM"}


@pytest.mark.parametrize("script", sorted(REFERENCES))
@pytest.mark.parametrize("checkout", ["none given", "not a checkout"])
def test_missing_reference_checkout_is_one_line_saying_where_to_get_it(script, checkout, tmp_path):
    arguments = [] if checkout == "none given" else ["--reference", str(tmp_path / "nothing-here")]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "references" / script), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"https://github.com/{REFERENCES[script]}" in lines[0]
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.skipif(not os.environ.get("HRM_REFERENCE"), reason="HRM_REFERENCE: a checkout of sapientinc/HRM")
@pytest.mark.parametrize("processes", ["one", "two"])
def test_hrm_reference_one_step_each(tmp_path, processes):
    """With a checkout (HRM_REFERENCE=PATH), one timed step of each side at cpu-small sizes ends with the ratio, both
    sides in one process or each in its own."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "references" / "hrm.py"), "--reference",
         os.environ["HRM_REFERENCE"], "--steps", "1", "--rounds", "1", "--processes", processes],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("ratio reference/ours per step = ")
