"""bf16 on a CPU without bf16 instructions: one warning line with the cost measured on this machine."""

import math

import pytest
from conftest import TOY, run_recipe

from toolkit import precision

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu vme sse2 avx avx2 fma\n"
X86_AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize("cpuinfo, native", [(X86_AVX2, False), (X86_AVX512_BF16, True), (X86_AMX, True),
                                              (ARM_BF16, True), (ARM_OLD, False), ("", False)])
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert precision.has_native_bf16(cpuinfo) is native


def test_the_measured_cost_is_a_ratio_of_two_real_timings():
    cost = precision.bf16_matmul_cost(size=64, repeats=3)
    assert math.isfinite(cost) and cost > 0


@pytest.mark.parametrize("cpuinfo, warned", [(X86_AVX2, True), (X86_AVX512_BF16, False)], ids=["avx2", "avx512-bf16"])
def test_a_bf16_run_on_a_cpu_without_bf16_says_what_it_costs_once(cpuinfo, warned, tmp_path):
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    result = run_recipe(["--mixed-precision", "bf16", "--max-steps", "2", "--log-with", "none", "--output-dir",
                         str(tmp_path / "run")], recipe=TOY, config="cpu_2proc.yaml",
                        env={"TOOLKIT_CPUINFO": str(tmp_path / "cpuinfo")})
    lines = [line for line in result.stdout.splitlines() if "bf16 instructions" in line]
    if warned:  # the main process alone measures and says it
        assert len(lines) == 1 and lines[0].startswith("warning: --mixed-precision bf16 on a CPU without"), lines
        assert float(lines[0].split(" takes ")[1].split("x as long")[0]) > 0
    else:
        assert lines == []
