"""benchmarks/products.py: both libraries' products timed at HRM's shapes, and the choice this machine makes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.kernels import onednn

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
def test_products_benchmark_times_both_libraries_and_names_this_machine_s_choice():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "products.py"), "--rows", "300", "--repeats", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\| (forward|weight gradient)[^|]+\| ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.MULTILINE)
    assert len(rows) == 9 and all(float(dnn) > 0 and float(mkl) > 0 for _, dnn, mkl in rows)
    lines = result.stdout.strip().splitlines()
    assert lines[-3].startswith("CPU: ") and lines[-1].startswith("sum: onednn ")
    assert lines[-2] == f"products_by() here: {onednn.products_by()}"


def test_products_benchmark_refuses_nonsense_in_one_line():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "products.py"), "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "error: --repeats 0 is invalid; give an integer >= 1"
    )
