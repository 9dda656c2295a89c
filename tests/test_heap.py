"""toolkit.process.heap: with glibc's thresholds set, a step's tensors freed and taken again by the next step cost no
page
faults; without them (or where the user chose glibc's settings) the 32 MB one is mapped afresh every step, 8k faults.
A run's process has them from start_run on. Each case in a fresh process: the thresholds are the process's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import recipe_env

from toolkit.process import heap

PROBE = textwrap.dedent("""
    import contextlib, json, resource, sys, torch
    from toolkit.process import heap
    from toolkit.run.config import TrainConfig
    from toolkit.run.start import start_run
    mode = sys.argv[1]
    if mode == "keep":
        heap.keep_between_steps()
    run = (start_run(TrainConfig(output_dir=sys.argv[2], log_with="none"), recipe="heap") if mode == "run"
           else contextlib.nullcontext())
    with run:
        torch.set_num_threads(1)
        faults = []
        for _ in range(8):  # a step: tensors of 2 to 32 MB written, read and freed
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step = [torch.ones(megabytes << 18) for megabytes in (8, 16, 4, 32, 2)]
            total = sum(float(tensor.sum()) for tensor in step)
            del step
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": bool(heap._kept), "faults": faults}))
""")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")


def probe(mode: str, tmp_path, **env: str) -> dict:
    chosen = (*heap.USER_SETTINGS, "GLIBC_TUNABLES", "LD_PRELOAD")  # this process's own: the probe starts without
    clean = {k: v for k, v in recipe_env().items() if k not in chosen}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(tmp_path / "run")],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["keep", "run"])
def test_a_kept_heap_takes_a_freed_block_again_without_page_faults(mode, tmp_path):
    """keep_between_steps itself, and a run's process (start_run calls it), against glibc's default."""
    kept, default = probe(mode, tmp_path), probe("default", tmp_path)
    assert kept["kept"] is True and default["kept"] is False
    # glibc's default maps the 32 MB tensor afresh every step (above its dynamic limit), 8,192 pages; kept, the heap
    # settles in the first steps and the later ones take their memory from it
    assert min(default["faults"][4:]) > 8_000
    assert max(kept["faults"][4:]) < 2_000  # (a stray 2 MB: 512)


@pytest.mark.parametrize(
    "setting", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}]
)
def test_the_user_s_own_glibc_settings_are_kept(setting, tmp_path):
    chosen = probe("run", tmp_path, **setting)
    assert chosen["kept"] is False and min(chosen["faults"][4:]) > 8_000
