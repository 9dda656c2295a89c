"""toolkit.heap: with glibc's thresholds set, a step's tensors freed and taken again by the next step cost no page
faults; without them (or where the user chose glibc's settings) the 32 MB one is mapped afresh every step, 8k faults.
Each case in a fresh process: the thresholds are the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from toolkit import heap

PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    from toolkit import heap
    kept = heap.keep_between_steps() if sys.argv[1] == "keep" else False
    torch.set_num_threads(1)
    faults = []
    for _ in range(8):  # a step: tensors of 2 to 32 MB written, read and freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step = [torch.ones(megabytes << 18) for megabytes in (8, 16, 4, 32, 2)]
        total = sum(float(tensor.sum()) for tensor in step)
        del step
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": kept, "faults": faults}))
""")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in heap.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kept_heap_takes_a_freed_block_again_without_page_faults():
    kept, default = probe("keep"), probe("default")
    assert kept["kept"] is True and default["kept"] is False
    # glibc's default maps the 32 MB tensor afresh every step (above its dynamic limit), 8,192 pages; kept, the heap
    # settles in the first steps and the later ones take their memory from it
    assert min(default["faults"][4:]) > 8_000
    assert max(kept["faults"][4:]) < 500


@pytest.mark.parametrize(
    "setting", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}]
)
def test_the_user_s_own_glibc_settings_are_kept(setting):
    chosen = probe("keep", **setting)
    assert chosen["kept"] is False and min(chosen["faults"][4:]) > 8_000
