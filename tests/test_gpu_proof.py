"""benchmarks/gpu_proof.py cannot rot before a GPU comes: its --cpu profile runs the whole sequence here (every
recipe in fp32 and bf16, fp16's refusal on the CPU, exact resume, the sudoku-1k and metr-la presets,
CPU scaling) through real launches, and the report must hold a figure for each."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from conftest import DATA_CACHE, ROOT

pytestmark = pytest.mark.slow
PROOF = str(ROOT / "benchmarks" / "gpu_proof.py")


def table_rows(report: str) -> dict[tuple[str, str], tuple[str, str]]:
    """{(section, check): (status, detail)} from the report's status table."""
    rows = {}
    for section, check, status, _seconds, detail in re.findall(
        r"^\| ([\w-]+) \| (.+?) \| (PASS|FAIL|SKIP) \| (\d+) \| (.*) \|$", report, re.MULTILINE
    ):
        rows[(section, check)] = (status, detail)
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --cpu profile is CI's; a GPU machine runs the real one")
def test_the_cpu_profile_runs_every_check_and_reports_its_figures(tmp_path, movielens_cache):
    out = tmp_path / "REPORT.md"
    result = subprocess.run([sys.executable, PROOF, "--cpu", "--out", str(out), "--workdir", str(tmp_path / "work"),
                             "--cache-dir", str(DATA_CACHE)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    report = out.read_text()
    assert result.returncode == 0, report + result.stderr[-3000:]
    rows = table_rows(report)
    recipes = ["sasrec", "ufs_emulator", "dcrnn", "hrm"]
    expected = {("doctor", "python -m toolkit doctor"), ("throughput", "fp32 / bf16 / bf16+compile"),
                ("throughput", "dcrnn --sequence-kernel fused / cells"),
                ("hrm-sudoku-1k", "first 12 steps"), ("dcrnn-metr-la", "first epoch"),
                *{("precision", f"{r} {p}") for r in recipes for p in ("fp32", "bf16", "fp16", "bf16+compile",
                                                                     "bf16+cuda-graphs")},
                ("resume", "sasrec fp32 --deterministic"),
                *{("graphs", f"{r} captured = uncaptured") for r in ("ufs_emulator", "sasrec", "dcrnn")},
                *{("cpu-scaling", r) for r in ("ufs_emulator", "dcrnn")}}
    assert set(rows) == expected
    passed = {key for key, (status, _) in rows.items() if status == "PASS"}
    skipped = {key for key, (status, _) in rows.items() if status == "SKIP"}
    # fp16 needs a GPU (refused here, checked); a cold compile takes minutes per recipe on 2 cores (--compile-all)
    assert skipped == {("precision", f"{r} {p}") for r in recipes for p in ("fp16", "bf16+cuda-graphs",
                                                                           "bf16+compile")} | {
        ("graphs", f"{r} captured = uncaptured") for r in ("ufs_emulator", "sasrec", "dcrnn")}  # needs a GPU
    assert passed == expected - skipped
    for gpu_only in ("fp16", "bf16+cuda-graphs"):  # refused on the first recipe (checked), skipped on the others
        assert "refused on the CPU with one line" in rows[("precision", f"sasrec {gpu_only}")][1]
        assert all("checked on sasrec" in rows[("precision", f"{r} {gpu_only}")][1] for r in recipes[1:])
    for recipe in recipes:
        assert re.search(r"verify OK; [\d,]+ samples/s", rows[("precision", f"{recipe} bf16")][1])
    assert "byte-identical" in rows[("resume", "sasrec fp32 --deterministic")][1]
    kernels = rows[("throughput", "dcrnn --sequence-kernel fused / cells")][1]
    assert re.search(r"^fused [\d,]+, cells [\d,]+ samples/s \(fused / cells [\d.]+x\); auto takes cells here", kernels)
    hrm = rows[("hrm-sudoku-1k", "first 12 steps")][1]
    assert re.search(r"loss [\d.]+ -> [\d.]+ over 12 steps; peak [\d,]+ MB", hrm)
    assert re.search(r"12 sensors, 3 days: epoch 1 = \d+ steps", rows[("dcrnn-metr-la", "first epoch")][1])
    for recipe in ("ufs_emulator", "dcrnn"):
        for label in ("1 x 1", "2 x 1", "1 x 2"):
            assert re.search(rf"^\| {recipe} \| {label} \| [\d,]+ \| [\d.]+x \|", report, re.MULTILINE), (recipe, label)
    throughput = re.search(r"^\| ufs_emulator \| ([\d,]+) \| ([\d,]+) \| - \| - \| - \|", report, re.MULTILINE)
    assert throughput, report  # fp32, bf16 figures (no fp16, no compile, no CUDA graphs)


def test_without_cuda_it_asks_for_the_cpu_profile_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = subprocess.run([sys.executable, PROOF, "--out", str(tmp_path / "R.md")], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "error: CUDA is not available on this machine; run with --cpu for the same sequence on CPU configs")
    assert list(tmp_path.iterdir()) == []


def test_hrm_steps_sets_the_sudoku_check_and_too_few_is_one_line(tmp_path, movielens_cache):
    few = subprocess.run([sys.executable, PROOF, "--out", str(tmp_path / "R.md"), "--cpu", "--hrm-steps", "2"],
                         cwd=ROOT, capture_output=True, text=True)
    assert few.returncode == 2 and few.stderr.strip().splitlines() == [
        "error: --hrm-steps 2 is too few; give at least 4 (the loss is compared over them)"]
    assert list(tmp_path.iterdir()) == []
    cache = tmp_path / "cache"  # empty: the puzzles are built in the background from the start, then the run reads them
    done = subprocess.run([sys.executable, PROOF, "--out", str(tmp_path / "R.md"), "--cpu", "--only", "hrm-sudoku-1k",
                           "--hrm-steps", "8", "--workdir", str(tmp_path / "work"), "--cache-dir", str(cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = (tmp_path / "R.md").read_text()
    assert "| hrm-sudoku-1k | first 8 steps | PASS |" in report, done.stdout + done.stderr
    assert re.search(r"puzzles built in the background, waited \d+ s for them \|", report), report
    # one dataset in the cache: the run found the background's (built from its own flags), it built no other
    assert [p.name.split("-")[:2] for p in (cache / "processed").iterdir()] == [["sudoku", "generated"]]
