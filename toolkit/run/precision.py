"""Mixed precision on the CPU: bf16 pays only where the CPU has bf16 instructions.

Without them (x86 without AVX512_BF16 or AMX-BF16, Arm without BF16) PyTorch emulates bf16 matmuls through fp32
conversions, and `--mixed-precision bf16` makes a CPU run slower, not faster (4x to 5x slower for SASRec on an
AVX2 machine). `bf16_warning` measures that cost here, on a matmul of a typical layer's size, and says it in one
line, so the user decides with a figure in hand. The CPU's flags are read from /proc/cpuinfo (TOOLKIT_CPUINFO names
another file: how a test shows the line on a machine that has the instructions).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 (AVX-512 BF16, AMX), Arm (FEAT_BF16, "bf16")


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text (TOOLKIT_CPUINFO names another file); empty where there is none."""
    try:
        return Path(os.environ.get("TOOLKIT_CPUINFO", "/proc/cpuinfo")).read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags ("flags" on x86, "Features" on Arm) from /proc/cpuinfo's text."""
    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 vendor string ("GenuineIntel", "AuthenticAMD"); "" where /proc/cpuinfo names none (Arm)."""
    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    return next((value.strip() for name, _, value in (line.partition(":") for line in cpuinfo.splitlines())
                 if name.strip() == "vendor_id"), "")


SPEED_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512F", "avx512_bf16": "AVX512_BF16", "amx_bf16": "AMX-BF16",
               "amx_tile": "AMX"}  # the flags that decide how fast torch's CPU kernels are


def cpu_kind(cpuinfo: str | None = None, threads: int | str | None = None) -> str:
    """The CPU in one line for a benchmark's figures: model name, the speed-deciding flags it has, its CPU count and
    the intra-op threads of the measured work (`threads`: a count or words such as "1 and 2 per run"; default this
    process's torch threads), so figures from different machines are never read as if equal."""
    import torch

    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    flags = cpu_flags(cpuinfo)
    has = ", ".join(name for flag, name in SPEED_FLAGS.items() if flag in flags) or "no AVX2/AVX-512/AMX"
    threads = torch.get_num_threads() if threads is None else threads
    # An AVX2-only machine emulated on a newer one: torch's own kernels, oneDNN's and MKL's capped by these variables
    capped = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                         "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(name)]
    has += f" (kernels capped: {' '.join(capped)})" if capped else ""
    return f"{model}; {has}; {os.cpu_count()} CPUs; {threads} threads"


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    return bool(cpu_flags(cpuinfo) & NATIVE_BF16_FLAGS)


def bf16_matmul_cost(size: int = 256, repeats: int = 20) -> float:
    """Time of a [size x size] matmul under CPU bf16 autocast over its fp32 time (best of `repeats` each)."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: the run's seeding comes after
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)

    def best(run) -> float:
        run()  # warm-up: first-call dispatch and allocation
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
        return min(times)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    return best(bf16) / max(best(lambda: a @ b), 1e-9)


def bf16_warning() -> str | None:
    """One line when bf16 runs on a CPU without bf16 instructions (None when it has them)."""
    if has_native_bf16():
        return None
    cost = bf16_matmul_cost()
    return (f"warning: --mixed-precision bf16 on a CPU without bf16 instructions (no AVX512_BF16 or AMX flag): a "
            f"256 x 256 matmul takes {cost:.1f}x as long in bf16 as in fp32 here; --mixed-precision no is likely "
            "faster")
