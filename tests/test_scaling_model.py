"""benchmarks/scaling_model.py: the speed-up model against numbers worked out by hand, and the script end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from scaling_model import (  # noqa: E402  benchmarks/ is not a package
    FIXED,
    MIB,
    PER_PROCESS,
    Link,
    allreduce_seconds,
    communication_seconds,
    ddp_buckets,
    linear_fit,
    predicted_speedup,
)

LINK = Link("test link", bandwidth=1e9, latency=1e-5)  # 1 GB/s, 10 us


def test_ring_allreduce_is_2_n_minus_1_over_n_bytes_over_bandwidth_plus_2_n_minus_1_latencies():
    # N=4, 1 GB: 2*3/4 * 1 s + 2*3 * 10 us = 1.5 s + 60 us
    assert allreduce_seconds(1e9, 4, LINK) == pytest.approx(1.5 + 60e-6)
    # N=2, 1 MB: 2*1/2 * 1 ms + 2 * 10 us = 1.02 ms
    assert allreduce_seconds(1e6, 2, LINK) == pytest.approx(1.02e-3)
    # N=16, nothing to send: latency only, 30 ring steps
    assert allreduce_seconds(0, 16, LINK) == pytest.approx(30 * 1e-5)
    assert allreduce_seconds(1e9, 1, LINK) == 0.0  # one process: nothing crosses a link


def test_gradients_go_in_ddp_buckets_of_1_mib_first_then_25_mib():
    assert ddp_buckets(500_000) == [500_000]
    assert ddp_buckets(30 * MIB) == [MIB, 25 * MIB, 4 * MIB]
    assert ddp_buckets(51 * MIB) == [MIB, 25 * MIB, 25 * MIB]


def test_communication_per_step_is_every_bucket_plus_the_small_collectives_latencies():
    # 30 MiB at N=2: buckets 1, 25, 4 MiB -> 30 MiB / 1 GB/s + 3 x 2 latencies; 2 small collectives: 2 x 2 latencies
    expected = 30 * MIB / 1e9 + 3 * 2e-5 + 2 * 2e-5
    assert communication_seconds(30 * MIB, 2, LINK, small_collectives=2) == pytest.approx(expected)
    assert communication_seconds(30 * MIB, 1, LINK, small_collectives=2) == 0.0


def test_speedup_at_a_fixed_global_batch_and_at_a_fixed_per_process_batch():
    compute = {128: 0.100, 64: 0.060, 32: 0.040}.__getitem__  # seconds per step by per-process batch
    # fixed global batch 128: one process 0.100 s a step; two split it: 0.060 s + 10 ms of all-reduce -> 1.4286x
    assert predicted_speedup(compute, 128, 2, 0.010, FIXED) == pytest.approx(0.100 / 0.070)
    # 4 processes of 32 with 20 ms of all-reduce: 0.100 / 0.060
    assert predicted_speedup(compute, 128, 4, 0.020, FIXED) == pytest.approx(0.100 / 0.060)
    # seed 000's mode: each process keeps 128, a step carries 2 x 128 samples in 0.110 s -> 2 x 0.100 / 0.110
    assert predicted_speedup(compute, 128, 2, 0.010, PER_PROCESS) == pytest.approx(2 * 0.100 / 0.110)
    # a fixed per-step overhead (the loop's own work) counts on both sides: (0.1 + 0.01) / (0.06 + 0.01 + 0.01)
    assert predicted_speedup(compute, 128, 2, 0.010, FIXED, overhead=0.010) == pytest.approx(0.110 / 0.080)
    assert predicted_speedup(compute, 128, 1, 0.0, FIXED) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mode"):
        predicted_speedup(compute, 128, 2, 0.010, "weak")


def test_linear_fit_recovers_the_per_step_cost_and_the_cost_per_sample():
    a, b = linear_fit({128: 0.002 + 128e-5, 64: 0.002 + 64e-5, 8: 0.002 + 8e-5})
    assert a == pytest.approx(0.002) and b == pytest.approx(1e-5)


@pytest.mark.slow
def test_quick_run_for_the_ufs_emulator_prints_the_table_the_check_and_a_summary():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling_model.py"), "--quick", "--families",
                           "ufs_emulator"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "loopback: toolkit doctor, 2 gloo processes" in out
    assert "== ufs_emulator:" in out and "b=1000:" in out and "b=62:" in out
    for link in ("loopback gloo", "10 GbE", "IB 100 Gb/s", "NVLink"):
        assert sum(line.startswith(link) for line in out.splitlines()) == 4, link  # N = 2, 4, 8, 16
    assert "check here, N=2, fixed global batch: predicted" in out and "measured" in out
    assert out.strip().splitlines()[-1].startswith("summary: 2 processes on 10 GbE")
    assert "ufs_emulator" in out.strip().splitlines()[-1]
