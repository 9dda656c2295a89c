"""One command that proves every GPU path of the toolkit and writes a Markdown report.

    python benchmarks/gpu_proof.py --out REPORT.md          # on a CUDA machine: about 20 minutes on one GPU
    python benchmarks/gpu_proof.py --cpu --out REPORT.md    # the same sequence on CPU configs with tiny sizes

The checks, in order; each is recorded (PASS, FAIL or SKIP with the reason) and a failure never stops the ones after
it. The report is rewritten after every check, so a run cut short still leaves what it measured.

1. doctor: `python -m toolkit doctor` on this machine.
2. precision: every recipe, a short run with accelerate_configs/1gpu.yaml (cpu.yaml with --cpu) in fp32, bf16, fp16,
   bf16 + --compile and bf16 + --cuda-graphs (refused on CPU), each followed by `toolkit verify`; fp16's checkpoint
   must hold the grad scaler's state.
3. throughput: the steady-state samples/s of those runs (their last metrics.csv row: the first holds the warm-up and
   the compilation), side by side per recipe; and DCRNN's two step kernels (--sequence-kernel fused and cells, fp32)
   side by side, saying whether `auto`'s choice for this device is the faster.
4. graphs: the UFS MLP, SASRec and DCRNN, whose whole step --cuda-graphs captures as one CUDA graph, trained
   captured and uncaptured side by side (fp32, --deterministic): weights byte for byte and every logged loss equal.
5. resume: SASRec and HRM with --deterministic, in fp32, bf16 and bf16 + --cuda-graphs: stopped half-way and
   resumed, against the uninterrupted run: model weights compared byte for byte, and every logged loss.
6. hrm-sudoku-1k: the first 2,000 steps of `--preset sudoku-1k` (bf16 + --compile) on its generated hard puzzles:
   loss falling, step time, peak memory. The puzzles are built in the background from the start (~2.5 minutes of one
   core on the device machine's host), while the checks before this one run.
7. dcrnn-metr-la: the first epoch of `--preset metr-la` on a generated 207-sensor network: step time, peak memory.
8. cpu-scaling: the machine's CPU for the seeds' claims, UFS MLP and DCRNN: 1, 2, 4, 8 gloo processes of 1 thread
   (the same global batch), and 1 process x 1, 4, 16 threads.

Checks that would start after --budget-min minutes are skipped and listed as skipped in the report. On a machine
without network access, bring the MovieLens cache (`.cache/test-data`, which `make test` fills) for SASRec.
Every run goes through `accelerate launch`, as a user's does; the runs are kept under --workdir.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("sasrec", "ufs_emulator", "dcrnn", "hrm")
PRECISIONS = {  # the default --precisions
    "fp32": ["--mixed-precision", "no"],
    "bf16": ["--mixed-precision", "bf16"],
    "fp16": ["--mixed-precision", "fp16"],
    "bf16+compile": ["--mixed-precision", "bf16", "--compile"],
    "bf16+cuda-graphs": ["--mixed-precision", "bf16", "--cuda-graphs"],  # the CUDA-only one: refused on CPU
}
EXTRA_PRECISIONS = {"fp32+cuda-graphs": ["--mixed-precision", "no", "--cuda-graphs"]}  # asked for by --precisions
ON_GPU_ONLY = {"fp16": "--mixed-precision fp16", "bf16+cuda-graphs": "--cuda-graphs",
               "fp32+cuda-graphs": "--cuda-graphs"}  # flag named by the refusal
PRECISION_FLAGS = {**PRECISIONS, **EXTRA_PRECISIONS}
SECTIONS = ("doctor", "precision", "throughput", "graphs", "resume", "hrm-sudoku-1k", "dcrnn-metr-la", "cpu-scaling")
# the recipes whose whole step --cuda-graphs captures (toolkit.run.step_graph)
GRAPH_RECIPES = ("ufs_emulator", "sasrec", "dcrnn")


@dataclass
class Profile:
    """What the checks run with: full sizes on a GPU, tiny ones with --cpu (the same sequence, in seconds)."""

    name: str
    config: str  # the 1-device launch config
    steps: int  # a short run trains 2 x steps: warm-up (and compilation), then the timed half
    recipe_flags: dict[str, list[str]]
    hrm_steps: int
    hrm_flags: list[str]
    hrm_compile: list[str]  # sudoku-1k in bf16 + compile on a GPU (the paper's run); uncompiled on 2 CPU cores
    metr_la_network: tuple[int, int]  # (sensors, days) of the generated network
    metr_la_flags: list[str]
    scaling_steps: int
    processes: list[int]
    threads: list[int]
    compile_recipes: tuple[str, ...] = RECIPES  # with --cpu: a cold compile takes minutes per recipe on 2 cores
    resume_precisions: tuple[str, ...] = ("fp32", "bf16", "bf16+cuda-graphs")
    resume_recipes: tuple[str, ...] = ("sasrec", "hrm")
    run_timeout: float = 600.0


def gpu_profile(data: dict[str, Path], cache: Path) -> Profile:
    return Profile(
        name="gpu",
        config="1gpu.yaml",
        steps=100,
        recipe_flags={
            "sasrec": ["--cache-dir", str(cache)],
            "ufs_emulator": ["--data", str(data["ufs"])],
            "dcrnn": ["--data", str(data["traffic"]), "--cache-dir", str(cache)],
            "hrm": ["--cache-dir", str(cache)],
        },
        hrm_steps=2000,
        hrm_flags=["--cache-dir", str(cache)],
        hrm_compile=["--compile"],
        metr_la_network=(207, 119),
        metr_la_flags=["--cache-dir", str(cache)],
        scaling_steps=40,
        processes=[1, 2, 4, 8],
        threads=[1, 4, 16],
    )


def cpu_profile(data: dict[str, Path], cache: Path) -> Profile:
    tiny_hrm = ["--train-puzzles", "16", "--aug", "1", "--val-puzzles", "8", "--test-puzzles", "8", "--hidden", "16",
                "--heads", "2", "--expansion", "2", "--h-layers", "1", "--l-layers", "1", "--halt-max-steps", "2",
                "--batch-size", "8", "--warmup-steps", "2", "--threads", "1"]
    return Profile(
        name="cpu",
        config="cpu.yaml",
        steps=3,
        recipe_flags={
            "sasrec": ["--cache-dir", str(cache), "--hidden", "16", "--blocks", "1", "--maxlen", "20",
                       "--batch-size", "64"],
            "ufs_emulator": ["--data", str(data["ufs"]), "--batch-size", "40", "--hidden", "16"],
            "dcrnn": ["--data", str(data["traffic"]), "--cache-dir", str(cache), "--units", "8", "--batch-size", "32"],
            "hrm": ["--cache-dir", str(cache), *tiny_hrm, "--max-blanks", "8"],
        },
        hrm_steps=12,
        hrm_flags=["--cache-dir", str(cache), *tiny_hrm],
        hrm_compile=[],
        metr_la_network=(12, 3),
        metr_la_flags=["--cache-dir", str(cache), "--units", "8", "--batch-size", "32", "--threads", "1"],
        scaling_steps=3,
        processes=[1, 2],
        threads=[1, 2],
        compile_recipes=(),  # a cold compile takes 0.5-2.5 min per recipe on 2 cores: --compile-all runs them
        # (tests/test_compile_cache.py compiles the UFS MLP and resumes it)
        resume_precisions=("fp32",),
        resume_recipes=("sasrec",),  # HRM's exact resume (its carry) is tested by tests/test_hrm_recipe.py
        run_timeout=300.0,
    )


@dataclass
class Check:
    section: str
    name: str
    status: str = "PASS"  # PASS, FAIL, SKIP
    seconds: float = 0.0
    detail: str = ""
    log: str = ""  # the failing command's output tail


@dataclass
class Proof:
    profile: Profile
    workdir: Path
    out: Path
    budget_sec: float
    started: float = field(default_factory=time.perf_counter)
    checks: list[Check] = field(default_factory=list)
    tables: dict[str, list[str]] = field(default_factory=dict)  # section -> Markdown lines
    machine: str = ""
    puzzles: subprocess.Popen | None = None  # hrm-sudoku-1k's puzzles, built in the background (prepare_puzzles)

    # ---- running things -------------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.budget_sec - (time.perf_counter() - self.started)

    def launch(self, recipe: str, flags: list[str], name: str, config: str | None = None,
               launcher_flags: tuple[str, ...] = ()) -> tuple[Path, subprocess.CompletedProcess]:
        """One run of a recipe through `accelerate launch`; its output goes to logs/NAME.log."""
        out = self.workdir / "runs" / name
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / (config or self.profile.config)), "--main_process_port", "0",
                   *launcher_flags, str(ROOT / "recipes" / f"{recipe}.py"), "--output-dir", str(out), *flags]
        return out, self.command(command, name)

    def command(self, command: list[str], name: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TQDM_DISABLE": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "WANDB_MODE": "offline"}
        timeout = max(30.0, min(self.profile.run_timeout, self.remaining()))
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            out = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) else \
                (expired.stdout or "")
            result = subprocess.CompletedProcess(command, 124, out, f"timed out after {timeout:.0f} s")
        log.write_text(f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}")
        return result

    def check(self, section: str, name: str, body) -> Check:
        """Run body(check) as one check: an exception or a failed command is a FAIL, the sequence goes on."""
        check = Check(section, name)
        if self.remaining() <= 0:
            check.status, check.detail = "SKIP", "over the time budget (--budget-min)"
        else:
            began = time.perf_counter()
            try:
                body(check)
            except Failed as failure:
                check.status, check.detail, check.log = "FAIL", failure.detail, failure.log
            except Exception as error:  # a bug in a check must not cost the checks after it
                check.status, check.detail = "FAIL", f"{type(error).__name__}: {error}"
            check.seconds = time.perf_counter() - began
        self.checks.append(check)
        mark = {"PASS": "ok", "FAIL": "FAILED", "SKIP": "skipped"}[check.status]
        print(f"[{self.elapsed():6.0f} s] {section} / {name}: {mark} {check.detail}", flush=True)
        self.write_report()
        return check

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # ---- the report -----------------------------------------------------------------------------------------------
    def write_report(self) -> None:
        counts = {s: sum(c.status == s for c in self.checks) for s in ("PASS", "FAIL", "SKIP")}
        lines = [
            f"# GPU proof, {datetime.date.today().isoformat()} ({self.profile.name} profile)",
            "",
            f"{self.machine}",
            "",
            f"Command: `python benchmarks/gpu_proof.py {' '.join(sys.argv[1:])}`; {self.elapsed() / 60:.1f} min; "
            f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped.",
            "",
            "| section | check | status | seconds | detail |",
            "| --- | --- | --- | ---: | --- |",
        ]
        for c in self.checks:
            lines.append(f"| {c.section} | {c.name} | {c.status} | {c.seconds:.0f} | {c.detail.replace('|', '/')} |")
        for section in SECTIONS:
            if self.tables.get(section):
                lines += ["", f"## {section}", "", *self.tables[section]]
        failed = [c for c in self.checks if c.status == "FAIL" and c.log]
        if failed:
            lines += ["", "## Output of the failed checks (last lines)"]
            for c in failed:
                lines += ["", f"### {c.section} / {c.name}", "", "```", c.log.strip(), "```"]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.out)


class Failed(Exception):
    def __init__(self, detail: str, log: str = ""):
        super().__init__(detail)
        self.detail, self.log = detail, log


def require_success(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        tail = (result.stdout[-2000:] + "\n" + result.stderr[-4000:]).strip()
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        raise Failed(f"{what} exited {result.returncode}" + (f": {errors[0]}" if errors else ""), tail)


def metrics_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def verify(run_dir: Path) -> str:
    """`python -m toolkit verify RUN_DIR`, in this process (the same code as the command)."""
    from toolkit.tools.verify import inspect_run

    problems = inspect_run(run_dir).problems
    if problems:
        raise Failed(f"verify: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return "verify OK"


def logged_losses(run_dir: Path) -> dict[int, str]:
    """{step: train/loss as written} from log.csv (--log-with csv): compared as text, i.e. exactly."""
    with open(run_dir / "log.csv", newline="") as handle:
        return {int(r["step"]): r["value"] for r in csv.DictReader(handle) if r["name"] == "train/loss"}


# ---- data ---------------------------------------------------------------------------------------------------------
def prepare_data(workdir: Path, profile_name: str) -> dict[str, Path]:
    """The generated inputs every profile needs (the SASRec data is MovieLens-100K from the cache)."""
    from toolkit.data.traffic import generate, write_dataset
    from toolkit.data.ufs import synthesize

    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    grid = (180, 360) if profile_name == "gpu" else (24, 48)
    network = (50, 28) if profile_name == "gpu" else (10, 5)
    paths = {"ufs": data / f"ufs-{grid[0]}x{grid[1]}.nc", "traffic": data / f"traffic-{network[0]}x{network[1]}"}
    if not paths["ufs"].exists():
        synthesize(paths["ufs"], seed=0, nlat=grid[0], nlon=grid[1])
    if not (paths["traffic"] / "adj_mx.pkl").exists():
        write_dataset(paths["traffic"], *generate(network[0], network[1], seed=0, progress=False))
    return paths


# ---- the checks ---------------------------------------------------------------------------------------------------
def check_doctor(proof: Proof, check: Check) -> None:
    result = proof.command([sys.executable, "-m", "toolkit", "doctor"], "doctor")
    require_success(result, "toolkit doctor")
    summary = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("toolkit doctor:")]
    check.detail = summary[0] if summary else "OK"


def check_precision(proof: Proof, recipe: str, precision: str, check: Check, runs: dict) -> None:
    steps = proof.profile.steps
    if precision == "bf16+compile" and recipe not in proof.profile.compile_recipes:
        check.status, check.detail = "SKIP", "not in this profile (the cold compile takes minutes on 2 cores)"
        return
    flags = [*proof.profile.recipe_flags[recipe], *PRECISION_FLAGS[precision], "--max-steps", str(2 * steps),
             "--eval-every-steps", str(steps), "--log-with", "csv"]
    on_cpu = proof.profile.name == "cpu"
    if precision in ON_GPU_ONLY and on_cpu and recipe != RECIPES[0]:
        check.status = "SKIP"
        check.detail = f"{precision} needs a GPU (its refusal on the CPU is checked on {RECIPES[0]})"
        return
    run_dir, result = proof.launch(recipe, flags, f"{recipe}-{precision}")
    if precision in ON_GPU_ONLY and on_cpu:  # fp16: Accelerate would train in fp32; CUDA graphs: no CUDA. Refused
        flag = ON_GPU_ONLY[precision]
        if result.returncode != 0 and flag in result.stderr and ("needs a GPU" in result.stderr
                                                                  or "needs a CUDA device" in result.stderr):
            check.status = "SKIP"
            check.detail = f"{precision} needs a GPU: refused on the CPU with one line, as designed"
            return
        raise Failed(f"{precision} on the CPU was not refused with its one-line error", result.stderr[-3000:])
    require_success(result, f"{recipe} {precision}")
    details = [verify(run_dir)]
    rows = metrics_rows(run_dir)
    rate = number(rows[-1].get("throughput_samples_per_sec"))
    memory = number(rows[-1].get("peak_memory_mb"))
    runs[(recipe, precision)] = {"rate": rate, "memory": memory, "loss": number(rows[-1].get("train_loss"))}
    if precision == "fp16":
        saved = run_dir / "checkpoints" / f"step_{2 * steps}"
        scaler = sorted(p.name for p in saved.glob("scaler*.pt"))
        if not scaler:
            raise Failed(f"fp16: no grad scaler state in {saved.name} ({', '.join(p.name for p in saved.iterdir())})")
        import torch

        state = torch.load(saved / scaler[0], weights_only=False)
        details.append(f"scaler state saved (scale {state.get('scale', '?')})")
    details.append(f"{rate:,.0f} samples/s" if rate else "no throughput")
    check.detail = "; ".join(details)


def throughput_table(proof: Proof, runs: dict, recipes=RECIPES) -> None:
    lines = ["Steady-state training samples/s (the last metrics.csv row of each precision run: "
             f"{proof.profile.steps} steps after as many warm-up steps), and peak memory (MB).", "",
             f"| recipe | {' | '.join(PRECISIONS)} | bf16 / fp32 | bf16+compile / bf16 | bf16+cuda-graphs / bf16 | "
             "peak MB fp32 / bf16 |",
             f"| --- |{' ---: |' * (len(PRECISIONS) + 4)}"]

    def rate(recipe, precision):
        return (runs.get((recipe, precision)) or {}).get("rate")

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    for recipe in recipes:
        cells = [f"{rate(recipe, p):,.0f}" if rate(recipe, p) else "-" for p in PRECISIONS]
        mem = [f"{(runs.get((recipe, p)) or {}).get('memory') or 0:,.0f}" for p in ("fp32", "bf16")]
        lines.append(f"| {recipe} | {' | '.join(cells)} | {ratio(rate(recipe, 'bf16'), rate(recipe, 'fp32'))} | "
                     f"{ratio(rate(recipe, 'bf16+compile'), rate(recipe, 'bf16'))} | "
                     f"{ratio(rate(recipe, 'bf16+cuda-graphs'), rate(recipe, 'bf16'))} | {' / '.join(mem)} |")
    proof.tables["throughput"] = lines


def check_throughput(proof: Proof, runs: dict, check: Check, recipes=RECIPES, precisions=tuple(PRECISIONS)) -> None:
    throughput_table(proof, runs, recipes)
    measured = ("fp32", "bf16", "bf16+compile") + (("bf16+cuda-graphs",) if proof.profile.name == "gpu" else ())
    wanted = [(r, p) for r in recipes for p in measured
              if p in precisions and (p != "bf16+compile" or r in proof.profile.compile_recipes)]
    missing = [f"{r} {p}" for r, p in wanted if not (runs.get((r, p)) or {}).get("rate")]
    if missing:
        raise Failed(f"no figure for {', '.join(missing)} (their runs failed)")
    if {"fp32", "bf16"} <= set(precisions):
        check.detail = "; ".join(f"{r}: bf16 {runs[(r, 'bf16')]['rate'] / runs[(r, 'fp32')]['rate']:.2f}x fp32"
                                 for r in recipes)


def check_sequence_kernels(proof: Proof, check: Check) -> None:
    """DCRNN's two ways of computing a step (--sequence-kernel: fused, one autograd function over the sequence with
    928 launches a step; cells, autograd cell by cell, 3,009), each in fp32, side by side: `auto` takes fused on CUDA,
    cells on CPU; this says whether that choice is the faster one on this machine."""
    steps = proof.profile.steps
    rates = {}
    for kernel in ("fused", "cells"):
        flags = [*proof.profile.recipe_flags["dcrnn"], *PRECISIONS["fp32"], "--sequence-kernel", kernel,
                 "--max-steps", str(2 * steps), "--eval-every-steps", str(steps), "--log-with", "csv"]
        run_dir, result = proof.launch("dcrnn", flags, f"dcrnn-kernel-{kernel}")
        require_success(result, f"dcrnn --sequence-kernel {kernel}")
        verify(run_dir)
        rates[kernel] = number(metrics_rows(run_dir)[-1].get("throughput_samples_per_sec"))
    if not all(rates.values()):
        raise Failed(f"no throughput figure: {rates}")
    auto = "fused" if proof.profile.name == "gpu" else "cells"
    faster = max(rates, key=rates.get)
    check.detail = (f"fused {rates['fused']:,.0f}, cells {rates['cells']:,.0f} samples/s (fused / cells "
                    f"{rates['fused'] / rates['cells']:.2f}x); auto takes {auto} here: "
                    f"{'the faster' if auto == faster else 'NOT the faster'}")


def check_resume(proof: Proof, recipe: str, precision: str, check: Check) -> None:
    steps = proof.profile.steps
    base = [*proof.profile.recipe_flags[recipe], *PRECISION_FLAGS[precision], "--deterministic", "--eval-every-steps",
            str(steps), "--checkpoint-every", str(steps), "--log-with", "csv", "--log-every", "1"]
    tag = f"{recipe}-{precision}-resume"
    straight, result = proof.launch(recipe, [*base, "--max-steps", str(2 * steps)], f"{tag}-straight")
    require_success(result, "the uninterrupted run")
    resumed, result = proof.launch(recipe, [*base, "--max-steps", str(steps)], f"{tag}-part")
    require_success(result, "the first half")
    resumed, result = proof.launch(recipe, [*base, "--max-steps", str(2 * steps), "--resume-from", "auto"],
                                   f"{tag}-part")
    require_success(result, "the resumed half")
    verify(resumed)
    check.detail = f"{same_training(straight, resumed, 2 * steps, 'resumed != uninterrupted')} (stopped and resumed " \
                   f"at step {steps}); verify OK"


def same_training(a_dir: Path, b_dir: Path, step: int, differ: str) -> str:
    """Two runs' weights at `step` byte for byte and every logged loss: the detail when equal, else Failed."""
    from safetensors.torch import load_file

    a, b = (d / "checkpoints" / f"step_{step}" / "model.safetensors" for d in (a_dir, b_dir))
    losses = logged_losses(a_dir) == logged_losses(b_dir)
    if a.read_bytes() == b.read_bytes() and losses:
        return f"weights at step {step} byte-identical, {len(logged_losses(a_dir))} logged losses equal"
    wa, wb = load_file(str(a)), load_file(str(b))
    differing = [k for k in wa if not wa[k].equal(wb[k])]
    worst = max(((wa[k].float() - wb[k].float()).abs().max().item() for k in differing), default=0.0)
    raise Failed(f"{differ}: {len(differing)} of {len(wa)} tensors differ (max |diff| {worst:.3g}); "
                 f"logged losses {'equal' if losses else 'differ'}")


def check_graphs(proof: Proof, recipe: str, check: Check) -> None:
    """--cuda-graphs captures the whole step and replays it: trained side by side with the uncaptured step (fp32,
    --deterministic), the weights and every logged loss must be equal. A value the step read on the host and the
    graph baked in (an epoch, a learning rate, a seed) would make them differ."""
    if proof.profile.name == "cpu":
        check.status, check.detail = "SKIP", "needs a GPU (--cuda-graphs is refused on the CPU)"
        return
    steps = proof.profile.steps
    base = [*proof.profile.recipe_flags[recipe], *PRECISIONS["fp32"], "--deterministic", "--max-steps",
            str(2 * steps), "--eval-every-steps", str(steps), "--log-with", "csv", "--log-every", "1"]
    uncaptured, result = proof.launch(recipe, base, f"{recipe}-graphs-off")
    require_success(result, "the uncaptured run")
    captured, result = proof.launch(recipe, [*base, "--cuda-graphs"], f"{recipe}-graphs-on")
    require_success(result, "the captured run")
    said = [line for line in result.stdout.splitlines() if line.startswith("--cuda-graphs:")]
    if not any("whole step" in line and "captured as one CUDA graph" in line for line in said):
        raise Failed(f"no whole-step capture said: {said}", result.stdout[-3000:])
    verify(captured)
    check.detail = f"{same_training(uncaptured, captured, 2 * steps, 'captured != uncaptured')}; {said[0]}"


def hrm_sudoku_flags(profile: Profile) -> list[str]:
    return ["--preset", "sudoku-1k", *profile.hrm_flags, "--mixed-precision", "bf16", *profile.hrm_compile]


def puzzles_log(proof: Proof) -> Path:
    return proof.workdir / "logs" / "hrm-sudoku-1k-puzzles.log"


def prepare_puzzles(proof: Proof) -> subprocess.Popen:
    """Start building hrm-sudoku-1k's generated puzzles into its --cache-dir in the background, from the very flags
    its run takes (so the run finds them cached): on the device machine's host this is ~2.5 minutes of one core
    (2,100 hard puzzles and their table), which the checks before it overlap instead of waiting for."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import hrm; from toolkit.data.sudoku import load_sudoku; "
            "cfg = hrm.parse_config(hrm.PRESETS, sys.argv[2:]); "
            "load_sudoku(cfg.data, hrm.data_recipe(cfg), cfg.cache_dir.expanduser(), progress=False, "
            "full_test=cfg.full_test)")
    log = puzzles_log(proof)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-c", code, str(ROOT / "recipes"), *hrm_sudoku_flags(proof.profile)],
                                cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "TQDM_DISABLE": "1"})


def wait_for_puzzles(proof: Proof) -> str:
    """Wait for prepare_puzzles (within the budget); what it cost this check, for its detail."""
    if proof.puzzles is None:
        return ""
    began = time.perf_counter()
    try:
        code = proof.puzzles.wait(timeout=max(30.0, proof.remaining()))
    except subprocess.TimeoutExpired:
        proof.puzzles.kill()
        code = "timed out"
    if code != 0:  # the run builds them itself then (and says why if it cannot)
        return f"; background puzzle build failed ({code}; {puzzles_log(proof)})"
    return f"; puzzles built in the background, waited {time.perf_counter() - began:.0f} s for them"


def check_hrm_sudoku(proof: Proof, check: Check) -> None:
    steps = proof.profile.hrm_steps
    every = max(1, steps // 4)
    waited = wait_for_puzzles(proof)
    flags = [*hrm_sudoku_flags(proof.profile), "--max-steps", str(steps), "--eval-every-steps", str(every),
             "--log-with", "csv", "--log-every", str(max(1, steps // 40))]
    run_dir, result = proof.launch("hrm", flags, "hrm-sudoku-1k")
    require_success(result, "hrm --preset sudoku-1k")
    rows = metrics_rows(run_dir)
    with open(run_dir / "log.csv", newline="") as handle:
        losses = [(int(r["step"]), float(r["value"])) for r in csv.DictReader(handle) if r["name"] == "train/loss"]
    lines = ["| step | train loss (mean since last row) | val exact accuracy | ms per step | peak memory MB |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    previous = 0
    for row in rows:
        step = int(row["step"])
        seconds = number(row.get("epoch_time_sec"))
        per_step = f"{1000 * seconds / (step - previous):.0f}" if seconds and step > previous else "-"
        accuracy = next((row[k] for k in row if k.startswith("val_") and "exact" in k), "-")
        loss = number(row.get("train_loss"))
        lines.append(f"| {step} | {'-' if loss is None else f'{loss:.4f}'} | {accuracy} | {per_step} | "
                     f"{row.get('peak_memory_mb', '-')} |")
        previous = step
    proof.tables["hrm-sudoku-1k"] = [f"`{' '.join(['recipes/hrm.py', *flags])}`", "", *lines]
    tenth = max(1, len(losses) // 10)
    first = statistics.fmean(v for _, v in losses[:tenth])
    last = statistics.fmean(v for _, v in losses[-tenth:])
    peak = max(number(r.get("peak_memory_mb")) or 0 for r in rows)
    check.detail = f"loss {first:.3f} -> {last:.3f} over {steps} steps; peak {peak:,.0f} MB{waited}"
    if not last < first:
        raise Failed(f"the loss did not fall: {check.detail}")


def check_dcrnn_metr_la(proof: Proof, check: Check) -> None:
    from toolkit.data.traffic import generate, write_dataset

    sensors, days = proof.profile.metr_la_network
    data = proof.workdir / "data" / f"metr-la-like-{sensors}x{days}"
    if not (data / "adj_mx.pkl").exists():
        write_dataset(data, *generate(sensors, days, seed=0, progress=False))
    flags = ["--preset", "metr-la", "--data", str(data), *proof.profile.metr_la_flags, "--epochs", "1",
             "--log-with", "csv"]
    run_dir, result = proof.launch("dcrnn", flags, "dcrnn-metr-la")
    require_success(result, "dcrnn --preset metr-la")
    verify(run_dir)
    row = metrics_rows(run_dir)[-1]
    steps, seconds = int(row["step"]), number(row["epoch_time_sec"]) or 0.0
    check.detail = (f"{sensors} sensors, {days} days: epoch 1 = {steps} steps in {seconds:.1f} s "
                    f"({1000 * seconds / max(steps, 1):.0f} ms/step), val_mae {number(row.get('val_mae')) or 0:.2f}, "
                    f"peak {number(row.get('peak_memory_mb')) or 0:,.0f} MB")


def check_scaling(proof: Proof, recipe: str, check: Check) -> None:
    steps = proof.profile.scaling_steps
    base = [*proof.profile.recipe_flags[recipe], "--mixed-precision", "no", "--max-steps", str(2 * steps),
            "--eval-every-steps", str(steps), "--log-with", "none"]
    results = []
    for processes in proof.profile.processes:
        config = "cpu.yaml" if processes == 1 else "cpu_2proc.yaml"
        launcher = () if processes == 1 else ("--num_processes", str(processes))
        run_dir, result = proof.launch(recipe, [*base, "--threads", "1"], f"{recipe}-scaling-{processes}x1",
                                       config=config, launcher_flags=launcher)
        require_success(result, f"{processes} processes")
        results.append((f"{processes} x 1", processes, number(metrics_rows(run_dir)[-1]["throughput_samples_per_sec"])))
    for threads in proof.profile.threads:
        if threads == 1:
            continue  # 1 x 1 is the first processes run
        run_dir, result = proof.launch(recipe, [*base, "--threads", str(threads)], f"{recipe}-scaling-1x{threads}",
                                       config="cpu.yaml")
        require_success(result, f"{threads} threads")
        results.append((f"1 x {threads}", threads, number(metrics_rows(run_dir)[-1]["throughput_samples_per_sec"])))
    base_rate = results[0][2]
    lines = proof.tables.setdefault("cpu-scaling", [
        f"Training samples/s on this machine's CPU ({os.cpu_count()} cores), the same global batch; speed-up against "
        "1 process x 1 thread.", "",
        "| recipe | processes x threads | samples/s | speed-up | efficiency |", "| --- | --- | ---: | ---: | ---: |"])
    for label, workers, rate in results:
        speedup = rate / base_rate
        lines.append(f"| {recipe} | {label} | {rate:,.0f} | {speedup:.2f}x | {speedup / workers:.2f} |")
    check.detail = ", ".join(f"{label}: {rate / base_rate:.2f}x" for label, _, rate in results[1:])


def machine_line(profile: Profile) -> str:
    import accelerate
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        device = f"{name} ({memory:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        device = "no CUDA device"
    from toolkit.run.precision import cpu_kind

    return (f"Machine: {device}; CPU: {cpu_kind(threads='as each check says')}; "
            f"torch {torch.__version__}, accelerate {accelerate.__version__}, Python {platform.python_version()}.")


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the Markdown report to write")
    parser.add_argument("--cpu", action="store_true", help="the same sequence on CPU configs with tiny sizes")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs and logs go (default: a new temp dir)")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "test-data",
                        help="data cache: MovieLens-100K (prepared by `make test`), generated puzzles")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="skip the checks that would start after this many minutes (default: 20; --cpu: none)")
    parser.add_argument("--compile-all", action="store_true",
                        help="with --cpu: compile every recipe, not only the UFS MLP (minutes each on 2 cores)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES), metavar="RECIPE",
                        help=f"the recipes of the precision and throughput sections ({', '.join(RECIPES)})")
    parser.add_argument("--hrm-steps", type=int, default=None, metavar="N",
                        help="steps of the hrm-sudoku-1k check (default: the profile's; 2,000 take ~45 min on an H100 "
                             "today, so a GPU check wants a few hundred)")
    parser.add_argument("--precisions", nargs="+", choices=[*PRECISIONS, *EXTRA_PRECISIONS], default=list(PRECISIONS),
                        metavar="PRECISION", help=f"the precisions of the precision section ({', '.join(PRECISIONS)})")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)})")
    args = parser.parse_args(argv)
    if args.hrm_steps is not None and args.hrm_steps < 4:
        return refuse(f"--hrm-steps {args.hrm_steps} is too few; give at least 4 (the loss is compared over them)")
    if args.out.is_dir():
        return refuse(f"--out {args.out} is a directory; give a file name, e.g. {args.out}/REPORT.md")

    import torch

    if not args.cpu and not torch.cuda.is_available():
        return refuse("CUDA is not available on this machine; run with --cpu for the same sequence on CPU configs")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_proof: runs and logs under {workdir}", flush=True)
    data = prepare_data(workdir, "cpu" if args.cpu else "gpu")
    profile = (cpu_profile if args.cpu else gpu_profile)(data, args.cache_dir)
    if args.compile_all:
        profile.compile_recipes = RECIPES
    if args.hrm_steps is not None:
        profile.hrm_steps = args.hrm_steps
    budget = args.budget_min if args.budget_min is not None else (1e9 if args.cpu else 20.0)
    proof = Proof(profile, workdir, args.out, budget * 60)
    proof.machine = machine_line(profile)
    wanted = set(args.only)
    if "hrm-sudoku-1k" in wanted:
        proof.puzzles = prepare_puzzles(proof)

    if "doctor" in wanted:
        proof.check("doctor", "python -m toolkit doctor", lambda c: check_doctor(proof, c))
    runs: dict = {}
    if wanted & {"precision", "throughput"}:
        for recipe in args.recipes:
            for precision in args.precisions:
                proof.check("precision", f"{recipe} {precision}",
                            lambda c, r=recipe, p=precision: check_precision(proof, r, p, c, runs))
        proof.check("throughput", "fp32 / bf16 / bf16+compile",
                    lambda c: check_throughput(proof, runs, c, args.recipes, args.precisions))
        if "dcrnn" in args.recipes:
            proof.check("throughput", "dcrnn --sequence-kernel fused / cells",
                        lambda c: check_sequence_kernels(proof, c))
    if "graphs" in wanted:
        for recipe in GRAPH_RECIPES:
            proof.check("graphs", f"{recipe} captured = uncaptured", lambda c, r=recipe: check_graphs(proof, r, c))
    if "resume" in wanted:
        for recipe in [r for r in profile.resume_recipes if r in args.recipes]:  # (--recipes, --precisions narrow it)
            for precision in [p for p in profile.resume_precisions if p in args.precisions]:
                proof.check("resume", f"{recipe} {precision} --deterministic",
                            lambda c, r=recipe, p=precision: check_resume(proof, r, p, c))
    if "hrm-sudoku-1k" in wanted:
        proof.check("hrm-sudoku-1k", f"first {profile.hrm_steps} steps", lambda c: check_hrm_sudoku(proof, c))
    if "dcrnn-metr-la" in wanted:
        proof.check("dcrnn-metr-la", "first epoch", lambda c: check_dcrnn_metr_la(proof, c))
    if "cpu-scaling" in wanted:
        for recipe in ("ufs_emulator", "dcrnn"):
            proof.check("cpu-scaling", recipe, lambda c, r=recipe: check_scaling(proof, r, c))
    if proof.puzzles is not None and proof.puzzles.poll() is None:  # its check was skipped (the budget)
        proof.puzzles.kill()
    proof.write_report()
    failed = [c for c in proof.checks if c.status == "FAIL"]
    print(f"gpu_proof: report in {args.out}: {len(proof.checks) - len(failed)} of {len(proof.checks)} checks not "
          f"failed ({proof.elapsed() / 60:.1f} min)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # toolkit from this checkout, also when the package is not installed
    raise SystemExit(main())
