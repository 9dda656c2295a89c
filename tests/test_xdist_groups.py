"""The suite's `--dist loadgroup` (make test) puts an xdist_group's tests on one worker, so a module-scoped fixture
they share is made once: a real `pytest -n 2 --dist loadgroup` on three grouped tests with other tests between."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_groups_tests_run_on_one_worker_and_its_module_fixture_is_made_once(tmp_path):
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from xdist_groups import pytest_collection_modifyitems  # noqa: F401\n")
    made = tmp_path / "made.txt"
    (tmp_path / "test_grouped.py").write_text(f'''
import os
import pytest

@pytest.fixture(scope="module")
def expensive():
    with open({str(made)!r}, "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.xdist_group("g")
def test_first(expensive): pass

@pytest.mark.parametrize("i", range(8))
def test_between(i): pass

@pytest.mark.xdist_group("g")
def test_second(expensive): pass

@pytest.mark.xdist_group("g")
def test_third(expensive): pass
''')
    (tmp_path / "test_other.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(8))\n"
                                            "def test_other(i): pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                             "-v", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "19 passed" in result.stdout
    workers = {line.split()[0] for line in result.stdout.splitlines()
               if "PASSED" in line and "@g" in line and line.startswith("[gw")}
    assert len(workers) == 1, result.stdout  # the three grouped tests, each shown as test_...@g, on one worker
    assert len(made.read_text().split()) == 1, made.read_text()  # the fixture made once
