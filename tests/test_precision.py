"""bf16 on a CPU without bf16 instructions: one warning line with the cost measured on this machine."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TOY, run_recipe
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.run import precision

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu vme sse2 avx avx2 fma\n"
X86_AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_OLD = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(
    "cpuinfo, native",
    [(X86_AVX2, False), (X86_AVX512_BF16, True), (X86_AMX, True), (ARM_BF16, True), (ARM_OLD, False), ("", False)],
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert precision.has_native_bf16(cpuinfo) is native


def test_the_measured_cost_is_a_ratio_of_two_real_timings(monkeypatch):
    # A stand-in clock that only the matmuls move: the n-th matmul (seen below autocast, with the dtype it really ran
    # in) takes SCRIPT[n] seconds. Each run: one untimed warm-up, then `repeats` timed ones; the cost is the best
    # bf16 time over the best fp32 time. The script's best times are not its means, first or last, and the warm-ups
    # are the fastest of all, so a cost from any other reading, or a timed warm-up, gives another number.
    script = [0.01, 0.5, 0.3, 0.4, 0.01, 0.12, 0.2, 0.1]  # bf16: warm-up, 3 timed; fp32: warm-up, 3 timed
    now, ran = [0.0], []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                now[0] += script[len(ran)]
                ran.append((args[0].dtype, args[1].dtype, tuple(out.shape)))
            return out

    monkeypatch.setattr(precision, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    with Matmuls():
        cost = precision.bf16_matmul_cost(size=64, repeats=3)
    bf16, fp32 = (torch.bfloat16, torch.bfloat16, (64, 64)), (torch.float32, torch.float32, (64, 64))
    assert ran == [bf16] * 4 + [fp32] * 4  # both timings are real matmuls: the first under bf16 autocast
    assert cost == pytest.approx(min(script[1:4]) / min(script[5:8]), rel=1e-12)  # 0.3 / 0.1


@pytest.mark.parametrize("cpuinfo, warned", [(X86_AVX2, True), (X86_AVX512_BF16, False)], ids=["avx2", "avx512-bf16"])
def test_a_bf16_run_on_a_cpu_without_bf16_says_what_it_costs_once(cpuinfo, warned, tmp_path):
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    result = run_recipe(
        ["--mixed-precision", "bf16", "--max-steps", "2", "--log-with", "none", "--output-dir", str(tmp_path / "run")],
        recipe=TOY,
        config="cpu_2proc.yaml",
        env={"TOOLKIT_CPUINFO": str(tmp_path / "cpuinfo")},
    )
    lines = [line for line in result.stdout.splitlines() if "bf16 instructions" in line]
    if warned:  # the main process alone measures and says it
        assert len(lines) == 1 and lines[0].startswith("warning: --mixed-precision bf16 on a CPU without"), lines
        assert float(lines[0].split(" takes ")[1].split("x as long")[0]) > 0
    else:
        assert lines == []


def test_cpu_kind_names_the_model_and_the_flags_that_decide_speed():
    from toolkit.run.precision import cpu_kind

    cpuinfo = "model name\t: Some CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n"
    kind = cpu_kind(cpuinfo)
    assert kind.startswith("Some CPU 9000; AVX2, AVX-512F, AVX512_BF16, AMX; ") and kind.endswith(" threads")
    assert "no AVX2/AVX-512/AMX" in cpu_kind("model name : Old\nflags : fpu sse\n")
    assert cpu_kind(cpuinfo, threads="1 and 2 per run").endswith("; 1 and 2 per run threads")


def test_cpu_kind_says_when_the_kernels_are_capped_to_emulate_an_older_cpu(monkeypatch):
    from toolkit.run.precision import cpu_kind

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    kind = cpu_kind("model name\t: Some CPU\nflags\t\t: avx2 avx512f avx512_bf16\n", threads=1)
    assert "AVX512_BF16 (kernels capped: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2);" in kind


def test_every_benchmark_prints_the_cpus_kind():
    """A figure without the machine's kind is read as if every machine were equal: each benchmark script
    (and the side-by-side report the reference scripts share) prints toolkit.run.precision.cpu_kind."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = [p for p in [*root.glob("*.py"), *root.glob("references/*.py")] if "__main__" in p.read_text()]
    assert len(scripts) >= 12, scripts
    silent = [p.name for p in scripts if "cpu_kind(" not in p.read_text()
              and not ("report(" in p.read_text() and "cpu_kind(" in (root / "references/side_by_side.py").read_text())]
    assert silent == [], f"benchmarks that do not name the CPU: {silent}"
