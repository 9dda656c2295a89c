"""Kernels and host syncs per optimizer step of a recipe's real loop, counted on any machine.

    python benchmarks/launches.py --recipe ufs_emulator     # each recipe at its default preset
    python benchmarks/launches.py --recipe sasrec --steps 40 --warmup 5
    python benchmarks/launches.py --recipe hrm -- --batch-size 32      # flags after -- go to the recipe
    python benchmarks/launches.py --recipe ufs_emulator --outside-step  # what stays around a --cuda-graphs replay

The recipe's own main() runs in this process (TrainingLoop, Accelerator, the recipe's step, everything it does per
step) on generated data (SASRec: MovieLens-100K from --cache-dir), for --warmup + --steps optimizer steps. Over the
last --steps (the steady state) a TorchDispatchMode counts every aten op dispatched, the profiler's record_function
marks apart. Left out: evaluations, checkpoints and epoch ends (each with the read of the loss it needs first), and a
DataLoader's own work on the host (its sampler and collate); batches cut on the device (DeviceBatches) count.

- an op that is not a view is one kernel launch on a GPU (a foreach or fused op: one, though CUDA may split it);
- a sync is an op that needs a device value on the host: `_local_scalar_dense` (`.item()`, `bool(t)`, `float(t)`,
  `int(t)`), `nonzero`, `masked_select`, the `unique` family, and the tensor methods that copy to the host without a
  dispatch on a CPU tensor, counted by wrapping them: `.tolist()`, `.cpu()`, `.numpy()`.

Prints a table by op (count per step, most first; syncs marked), then `syncs/step = X` and `kernels/step = Y` last.
On CPU the counts are those a GPU would see: where the tensors live does not change which ops run, with two
exceptions. SASRec's `--loss ce` scores the targets' positions alone on a CPU, every position on a GPU (the default
BCE is the same on both). DCRNN's `--sequence-kernel auto` takes the fused kernel on CUDA and the cells on CPU, so
for dcrnn this counts `--sequence-kernel fused` with its diffusion operators dense (the path a CUDA run takes; on
CPU they are sparse CSR products, as many) unless the recipe's flags after -- name a kernel; the CPU's path:
`--recipe dcrnn -- --sequence-kernel cells`. A line before the totals says which was counted.

    python benchmarks/launches.py --recipe dcrnn --cpu-time 8    # DCRNN's two sequence kernels timed on this CPU

instead times a training step of DCRNN's two sequence kernels side by side on this CPU, no counting: the cpu
preset's model (2x16, K=2) on the generated network's graph, batch 64, scheduled-sampling coins at 0.5, an MAE loss,
backward, clipping at 5 and Adam, 1 thread; ROUNDS rounds of 5 steps, the kernels in turn within each
round (the machine may be shared), after 3 warm-up steps each; the median round per step, and fused / cells as the
median of the rounds' ratios and as the ratio of the fastest rounds.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from toolkit.process import begin_process  # noqa: E402

begin_process()  # as the recipes do

RECIPES = ("ufs_emulator", "sasrec", "dcrnn", "hrm")
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "unique_dim_consecutive", "item"}
MARKERS = {"_record_function_enter", "_record_function_enter_new", "_record_function_exit"}  # profiler marks: no kernel
HOST_COPIES = ("tolist", "cpu", "numpy")  # no dispatch on a CPU tensor: wrapped and counted by name


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while `counting` is set (views apart: they launch nothing)."""

    def __init__(self, where: str | None = None):
        super().__init__()
        self.counting = False
        self.ops: collections.Counter = collections.Counter()
        self.views = 0
        self.where, self.callers = where, collections.Counter()  # --where OP: the code that dispatches OP

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            if func.is_view:
                self.views += 1
            else:
                self.ops[func.overloadpacket.__name__] += 1
                if func.overloadpacket.__name__ == self.where:
                    self.callers[_our_frames()] += 1
        return func(*args, **(kwargs or {}))


def _our_frames() -> str:
    """The innermost frames of the project's own code (recipes/, toolkit/), as file:line < file:line ..."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/recipes/" in f.filename or "/toolkit/" in f.filename]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))


def _count_host_copies(counter: OpCounter) -> None:
    for name in HOST_COPIES:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            if counter.counting:
                counter.ops[f".{_name}()"] += 1
                if counter.where == f".{_name}()":
                    counter.callers[_our_frames()] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, wrapped)


def generated_data(recipe: str, where: Path) -> list[str]:
    """The flags that point a recipe at generated data (made here, small enough to make in seconds)."""
    if recipe == "ufs_emulator":
        from toolkit.data.ufs import synthesize

        return ["--data", str(synthesize(where / "gdas-like.nc", seed=0))]
    if recipe == "dcrnn":
        from toolkit.data.traffic import generate, write_dataset

        write_dataset(where / "synth-la", *generate(sensors=50, days=28, seed=0, progress=False))
        return ["--data", str(where / "synth-la")]
    return []  # sasrec: ml-100k from the cache dir; hrm: generated puzzles


def load_recipe(recipe: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def count(recipe: str, warmup: int, steps: int, extra: list[str], cache_dir: Path | None,
          where: str | None = None, outside_step: bool = False) -> tuple[dict, int]:
    from toolkit.loop import training as loop
    from toolkit.run import device_data

    counter = OpCounter(where)
    _count_host_copies(counter)
    first, last = warmup, warmup + steps

    def window(training_loop) -> None:  # after each optimizer step: count steps first+1 .. last
        counter.counting = first <= training_loop.progress.global_step < last

    def paused(method):  # evaluations and checkpoints are not the steady state
        def wrapper(*args, **kwargs):
            was, counter.counting = counter.counting, False
            try:
                return method(*args, **kwargs)
            finally:
                counter.counting = was

        return wrapper

    class PausedFetch:  # the loader's work on the host (sampler, collate): host tensors, no device sync
        def __init__(self, iterable):
            self.iterator = iter(iterable)

        def __iter__(self):
            return self

        @paused
        def __next__(self):
            return next(self.iterator)

    rest_of_epoch = loop.rest_of_epoch

    def fetch(accelerator, loader, batches_done):  # batches cut on the device (DeviceBatches) are device work: counted
        batches = rest_of_epoch(accelerator, loader, batches_done)
        return batches if hasattr(loader, "skip_first") else PausedFetch(batches)

    loop.rest_of_epoch = fetch
    if outside_step:  # the recipe's step (what --cuda-graphs replays as one graph) not counted
        loop.TrainingLoop.run_step = paused(loop.TrainingLoop.run_step)
    device_data.DeviceBatches.epoch_order = paused(device_data.DeviceBatches.epoch_order)  # the sampler, on the host
    loop.AFTER_STEP_HOOKS.append(window)
    for name in ("_validate", "save", "end_epoch"):  # each reads the unread losses first: its own cost
        setattr(loop.TrainingLoop, name, paused(getattr(loop.TrainingLoop, name)))
    with tempfile.TemporaryDirectory() as tmp:
        cache = ["--cache-dir", str(cache_dir)] if cache_dir else []
        # one step past the window: the last step's own read (the run's end) is not the steady state
        argv = [*generated_data(recipe, Path(tmp)), "--max-steps", str(last + 1), "--output-dir", f"{tmp}/run",
                "--log-with", "none", "--checkpoint-every", "0", *cache, *extra]
        main = load_recipe(recipe).main
        with counter:
            main(argv)
    for caller, n in counter.callers.most_common(8):
        print(f"{where} {n / steps:8.2f}/step  {caller}")
    return dict(counter.ops), steps


def time_dcrnn_kernels(rounds: int, steps: int = 5) -> dict[str, list[float]]:
    """{kernel: ms per training step of each round}, the cells and the fused kernel in turn (see the docstring)."""
    import statistics
    import time

    from toolkit.data.traffic import generate
    from toolkit.kernels import converted
    from toolkit.models.dcrnn import DCRNN

    torch.set_num_threads(1)
    _, _, adjacency = generate(sensors=50, days=28, seed=0, progress=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, 50, 2, generator=generator)
    truth = torch.randn(64, 12, 50, generator=generator)
    coins = torch.rand(64, 12, generator=generator) < 0.5
    runs = {}
    for kernel in ("cells", "fused"):
        torch.manual_seed(0)
        model = converted(DCRNN(adjacency, units=16, layers=2, diffusion_steps=2, horizon=12,
                                sequence_kernel=kernel))
        runs[kernel] = (model, torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3))

    def train(model, optimizer, count):
        for _ in range(count):
            (model(x, truth, coins) - truth).abs().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for model, optimizer in runs.values():
        train(model, optimizer, 3)
    times: dict[str, list[float]] = {kernel: [] for kernel in runs}
    for _ in range(rounds):
        for kernel, (model, optimizer) in runs.items():
            start = time.perf_counter()
            train(model, optimizer, steps)
            times[kernel].append((time.perf_counter() - start) / steps * 1e3)
    for kernel, values in times.items():
        print(f"dcrnn {kernel:<5} ms/step: median {statistics.median(values):.1f}; rounds "
              + " ".join(f"{v:.0f}" for v in values))
    ratios = [fused / cells for fused, cells in zip(times["fused"], times["cells"], strict=True)]
    print(f"dcrnn fused / cells = {statistics.median(ratios):.2f}, the median of the rounds' ratios (each round's "
          f"two kernels run one after the other; {rounds} rounds of {steps} steps); of the fastest rounds "
          f"{min(times['fused']) / min(times['cells']):.2f}")
    return times


def report(ops: dict, steps: int) -> tuple[float, float]:
    ops = {name: n for name, n in ops.items() if name not in MARKERS}
    syncs = sum(n for name, n in ops.items() if name in SYNC_OPS or name.startswith("."))
    kernels = sum(n for name, n in ops.items() if not name.startswith("."))
    print(f"{'op':<40} {'per step':>10}")
    for name, n in sorted(ops.items(), key=lambda item: (-item[1], item[0])):
        mark = "  sync" if name in SYNC_OPS or name.startswith(".") else ""
        print(f"{name:<40} {n / steps:>10.2f}{mark}")
    return syncs / steps, kernels / steps


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=RECIPES, required=True)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before counting")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps counted (the steady state)")
    parser.add_argument("--where", default=None, metavar="OP",
                        help="also print where the project's code dispatches OP (e.g. _local_scalar_dense, .tolist())")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the recipe's --cache-dir (default: its own)")
    parser.add_argument("--outside-step", action="store_true",
                        help="count only what runs outside the recipe's step (loop.run_step): what a --cuda-graphs "
                             "run still launches around each replay (ufs_emulator, sasrec, dcrnn)")
    parser.add_argument("--cpu-time", type=int, default=0, metavar="ROUNDS",
                        help="dcrnn: instead of counting, time both sequence kernels' training step on this CPU")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    if args.outside_step and args.recipe == "hrm":
        parser.error("--outside-step: hrm does not give its step to loop.run_step (--cuda-graphs keeps the model's "
                     "graphs there); give ufs_emulator, sasrec or dcrnn")
    if args.cpu_time:
        if args.recipe != "dcrnn" or args.cpu_time < 1:
            parser.error("--cpu-time ROUNDS (>= 1) times DCRNN's sequence kernels: give it with --recipe dcrnn")
        from toolkit.run.precision import cpu_kind

        time_dcrnn_kernels(args.cpu_time)
        print(f"torch {torch.__version__}; CPU: {cpu_kind()}")
        return
    kernel_line = None
    if args.recipe == "dcrnn":  # auto picks by device: count the CUDA run's kernel unless told which
        named = [a.split("=", 1)[1] if "=" in a else extra[i + 1] for i, a in enumerate(extra)
                 if a.split("=", 1)[0] == "--sequence-kernel" and ("=" in a or i + 1 < len(extra))]
        if not named:
            extra = ["--sequence-kernel", "fused", *extra]
        kernel = named[-1] if named else "fused"
        if kernel == "fused":  # its operators dense, as on CUDA (on CPU: sparse CSR; the same count, other op names)
            from toolkit.kernels import dcrnn

            dcrnn.FUSED_SPARSE_DENSITY = 0.0
        kernel_line = (f"dcrnn: --sequence-kernel {kernel} counted" + (
            " with dense diffusion operators, the path a CUDA run takes (auto = fused on CUDA, cells on CPU; the "
            "CPU's path: -- --sequence-kernel cells)" if kernel == "fused" else
            " (the path a CPU run takes with auto; a CUDA run's: --sequence-kernel fused)" if kernel == "cells"
            else ""))
    ops, steps = count(args.recipe, args.warmup, args.steps, extra, args.cache_dir, args.where, args.outside_step)
    syncs, kernels = report(ops, steps)
    from toolkit.run.precision import cpu_kind

    print(f"recipe {args.recipe}, {steps} steps counted after {args.warmup}; torch {torch.__version__}; "
          f"CPU: {cpu_kind()}")
    if kernel_line:
        print(kernel_line)
    if args.outside_step:
        print("outside the step only (loop.run_step not counted): a --cuda-graphs run launches these around each "
              "replay, plus one copy per batch tensor into the graph's static inputs and the replay itself")
    print(f"syncs/step = {syncs:.3f}")
    print(f"kernels/step = {kernels:.1f}")


if __name__ == "__main__":
    main()
