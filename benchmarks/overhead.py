"""What the toolkit's loop costs per step: one recipe's model and batches trained by a plain PyTorch loop, written as
the teams wrote theirs, and by the recipe's loop (Accelerator prepare/accumulate/autocast/backward, TrainingLoop's
batches() with its per-step reseeding, timing, step counting, loss check and progress bar, the recipe's loss
reduction), side by side in one process. Rounds alternate between the two so machine noise hits both alike.

    python benchmarks/overhead.py --recipe sasrec          # SASRec d=50, 2 blocks, maxlen 200, batch 128 (~250 ms/step)
    python benchmarks/overhead.py --recipe dcrnn           # DCRNN cpu preset on a generated 50-sensor network, batch 64
    python benchmarks/overhead.py --recipe ufs_emulator    # the UFS MLP 3 x 64, batch 1000 (~1 ms/step)
    python benchmarks/overhead.py --recipe hrm             # HRM cpu-small: hidden 64, 1+1 layers, batch 64 (~80 ms)
    python benchmarks/overhead.py --recipe sasrec --threads 1 --profile 5   # where the step goes (torch.profiler)

Both loops read the same dataset object through a DataLoader (same batch size, shuffled) and build the same model
from the same seed, in the same process with the same intra-op threads (--threads; default the recipe's), so the
ratio is the loop's own cost: the plain loop is zero_grad, forward, loss, backward, (clip,) step and loss.item()
per batch, as in the teams' code. Evaluation and checkpoints at epoch ends are in neither (the toolkit side rolls
its epochs over by hand). Prints each round, the median seconds per step of each, and `ratio toolkit/plain = X`
last: the median over the rounds of toolkit/plain (goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from toolkit.kernels import converted
from toolkit.loop.training import TrainingLoop
from toolkit.run.config import TrainConfig
from toolkit.run.devices import pin_memory
from toolkit.run.distributed import global_mean, mean_over_processes
from toolkit.run.precision import cpu_kind
from toolkit.run.randomness import UntouchedItems, keyed_uniform
from toolkit.run.sampler import shuffled_batches
from toolkit.run.start import start_run

RECIPES = ("sasrec", "dcrnn", "ufs_emulator", "hrm")
DEFAULT_STEPS = {"sasrec": 20, "dcrnn": 10, "ufs_emulator": 500, "hrm": 20}  # a round of each is a second or a few
DEFAULT_THREADS = {"sasrec": 0, "dcrnn": 1, "ufs_emulator": 1, "hrm": 1}  # the recipes' defaults (0: torch's)


@dataclass
class Workload:
    """One recipe's training step, written twice: as the plain loop does it and as the recipe does it."""

    dataset: torch.utils.data.Dataset
    batch_size: int
    make_model: Callable[[], torch.nn.Module]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    plain_loss: Callable  # (model, batch) -> loss
    recipe_loss: Callable  # (model, batch, loop, accelerator) -> (loss to backward, loss value for record_loss)
    max_grad_norm: float = 0.0
    collate_fn: Callable | None = None
    keyed_batches: bool = False  # the recipe cuts its batches with toolkit.run.sampler.shuffled_batches
    after_step: Callable[[torch.nn.Module, int], None] | None = None  # (model, step): a second optimizer (HRM's)


def sasrec_workload(cache_dir: Path) -> Workload:
    """recipes/sasrec.py's BCE step (one keyed negative per position), d=50, 2 blocks, maxlen 200, batch 128."""
    from toolkit.data.movielens import UserSequences, leave_one_out, prepare_movielens
    from toolkit.models.sasrec import SASRec

    sequences, meta = prepare_movielens("ml-100k", None, cache_dir)
    split = leave_one_out(sequences, meta, 200)
    data = UserSequences({"input": split.train_input, "target": split.train_target})
    samplers = {}

    def negatives_on(device):  # the recipe builds its sampler once, on the batches' device
        return samplers.setdefault(device, UntouchedItems(split.train_touched.to(device)))

    def bce_sum(model, batch, epoch):
        scorer = getattr(model, "module", model)  # the recipe scores through the unwrapped model
        inputs, targets = batch["input"], batch["target"]
        hidden = model(inputs)
        positions = targets > 0
        negatives = negatives_on(batch["user"].device).sample(
            batch["user"], torch.arange(inputs.shape[1]), seed=0, purpose=1, epoch=epoch
        )
        logits = scorer.score_items(hidden[positions], torch.stack([targets[positions], negatives[positions]], dim=1))
        labels = torch.zeros_like(logits)
        labels[:, 0] = 1.0
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"), positions.sum()

    def plain_loss(model, batch):
        loss_sum, count = bce_sum(model, batch, 0)
        return loss_sum / count

    def recipe_loss(model, batch, loop, accelerator):
        return global_mean(accelerator, *bce_sum(model, batch, loop.progress.epoch))

    return Workload(
        data,
        128,
        lambda: converted(SASRec(meta["num_items"], hidden=50, blocks=2, maxlen=200, dropout=0.2)),
        lambda model: torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98)),
        plain_loss,
        recipe_loss,
    )


def dcrnn_workload(data_dir: Path | None, cache_dir: Path) -> Workload:
    """recipes/dcrnn.py's step (cpu preset: 2 x 16 units, K=2, batch 64, scheduled sampling, masked MAE in mph,
    clip 5) on a generated 50-sensor network (--data, else 7 days generated in a temporary directory)."""
    from toolkit.data.traffic import OUTPUT_STEPS, generate, prepare_traffic, split_windows, write_dataset
    from toolkit.models.dcrnn import DCRNN, sampling_probability

    if data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="overhead-traffic-"))
        print(f"generating a 50-sensor, 7-day network in {data_dir} ...", flush=True)
        write_dataset(data_dir, *generate(50, 7, seed=0, progress=False))
    table, meta = prepare_traffic(data_dir, cache_dir)
    split = split_windows(table)
    scaler = split.scaler
    decay_steps = 80.0

    def masked_mae(model, batch, use_teacher):
        truth = batch["y"]
        predicted = scaler.inverse(model(batch["x"], scaler.transform(truth), use_teacher).float())
        observed = truth > 0
        return torch.where(observed, (predicted - truth).abs(), torch.zeros_like(predicted)).sum(), observed.sum()

    plain_steps = [0]

    def plain_loss(model, batch):  # the reference code's coins: one uniform draw per (window, decoder step)
        probability = sampling_probability(plain_steps[0], decay_steps)
        plain_steps[0] += 1
        use_teacher = (torch.rand(len(batch["window"]), OUTPUT_STEPS) < probability).to(batch["y"].device)
        error_sum, count = masked_mae(model, batch, use_teacher)
        return error_sum / count

    def recipe_loss(model, batch, loop, accelerator):
        step = loop.progress.global_step
        coins = keyed_uniform(0, 3, step, batch["window"][:, None].cpu(), torch.arange(OUTPUT_STEPS)[None, :])
        use_teacher = (coins < sampling_probability(step, decay_steps)).to(batch["y"].device)
        return global_mean(accelerator, *masked_mae(model, batch, use_teacher))

    return Workload(
        split.train,
        64,
        lambda: converted(DCRNN(
            meta["adjacency"], input_dim=2, output_dim=1, units=16, layers=2, diffusion_steps=2, horizon=OUTPUT_STEPS
        )),
        lambda model: torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3),
        plain_loss,
        recipe_loss,
        max_grad_norm=5.0,
    )


def ufs_workload() -> Workload:
    """recipes/ufs_emulator.py's step: the 3 x 64 GELU MLP, 14 inputs -> aice, MSE on normalised patterns, Adam 1e-4
    with weight decay 1e-4, batch 1000; 24,000 random normal patterns (the generated file's training count: the
    step's cost does not depend on the values), read whole batches at a time as the recipe reads them."""
    from toolkit.data.ufs import PatternRows, whole_batch
    from toolkit.models.ufs_emulator import UfsEmulator

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(24_000, 14, generator=generator)
    targets = torch.tanh(inputs[:, :1] + 0.5 * inputs[:, 1:2]) + 0.05 * torch.randn(24_000, 1, generator=generator)
    data = PatternRows({"x": inputs, "y": targets}, index_name="pattern")

    def plain_loss(model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"])

    def recipe_loss(model, batch, loop, accelerator):
        loss = F.mse_loss(model(batch["x"]).float(), batch["y"])  # equal per-rank batches: mean of means is global
        return loss, mean_over_processes(accelerator, loss.detach())

    return Workload(
        data,
        1000,
        lambda: UfsEmulator(torch.zeros(14), torch.ones(14), torch.zeros(1), torch.ones(1)),
        lambda model: torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-4),
        plain_loss,
        recipe_loss,
        collate_fn=whole_batch,
        keyed_batches=True,
    )


def hrm_workload() -> Workload:
    """recipes/hrm.py's step at cpu-small sizes (hidden 64, 4 heads, 1+1 layers, 1x1 cycles, at most 4 segments,
    batch 64): one ACT segment per batch with the carry, stablemax loss, clip 1.0, AdamATan2 and the puzzle
    embedding's SignSGD; 4,096 random Sudoku-shaped puzzles (the step's cost does not depend on the digits). The
    recipe's side also sums its training metrics on the device, as the recipe does (read at --log-every)."""
    from toolkit.data.ufs import PatternRows, whole_batch
    from toolkit.models.hrm import HRM, AdamATan2, SparseSignSGD, act_losses

    puzzles, cells, vocab, batch_size, exploration = 4096, 81, 11, 64, 11  # recipes/hrm.py's Sudoku and purpose
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(2, vocab, (puzzles, cells), generator=generator)
    inputs = torch.where(torch.rand(puzzles, cells, generator=generator) < 0.5, 1, labels)
    data = PatternRows({"inputs": inputs, "labels": labels}, index_name="ids")
    carries: dict[int, dict] = {}  # per model (each side has its own): the rows' recurrent state
    puzzle_optimizers: dict[int, SparseSignSGD] = {}

    def tokens(batch):
        return {"inputs": batch["inputs"], "labels": batch["labels"], "ids": batch["ids"],
                "puzzle_ids": torch.zeros_like(batch["ids"])}

    def segment(model, batch, step):
        core = getattr(model, "module", model)
        data = tokens(batch)
        state = carries.get(id(core)) or core.initial_carry(data)
        outputs = model(state, data, explore_key=(0, exploration, step))
        carries[id(core)] = outputs["carry"]
        return act_losses(outputs, "stablemax")

    plain_steps = [0]

    def plain_loss(model, batch):
        plain_steps[0] += 1
        loss, _ = segment(model, batch, plain_steps[0])
        return loss / batch_size

    def recipe_loss(model, batch, loop, accelerator):
        loss, sums = segment(model, batch, loop.progress.global_step + 1)
        totals = accelerator.reduce(torch.stack([loss.detach().double(), *sums.values()]), reduction="sum")
        return loss * (accelerator.num_processes / batch_size), totals[0].float() / batch_size  # per_row_loss

    def after_step(model, step):
        core = getattr(model, "module", model)
        puzzle_optimizer = puzzle_optimizers.setdefault(id(core), SparseSignSGD(core.puzzle_emb, 1e-2, 0.1))
        puzzle_optimizer.step(lr=1e-2 * min(1.0, step / 50))
        puzzle_optimizer.zero_grad()

    return Workload(
        data,
        batch_size,
        lambda: converted(HRM(vocab, cells, num_puzzle_ids=1, hidden=64, heads=4, expansion=4.0, h_layers=1,
                              l_layers=1, h_cycles=1, l_cycles=1, halt_max_steps=4, exploration_prob=0.1,
                              positions="rope")),
        lambda model: AdamATan2(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
        plain_loss,
        recipe_loss,
        max_grad_norm=1.0,
        collate_fn=whole_batch,
        keyed_batches=True,
        after_step=after_step,
    )


def plain_rounds(work: Workload, device: torch.device) -> Callable[[int], float]:
    """The plain loop, as the teams wrote it, on the device the toolkit's Accelerator chose (a GPU if there is one);
    returns a function timing `steps` steps (seconds per step)."""
    torch.manual_seed(0)
    model = work.make_model().to(device)
    optimizer = work.make_optimizer(model)
    loader = DataLoader(
        work.dataset, batch_size=work.batch_size, shuffle=True, drop_last=True, collate_fn=work.collate_fn,
        pin_memory=pin_memory(device),
    )
    running_loss = 0.0

    def timed(steps: int) -> float:
        nonlocal running_loss
        done, start = 0, time.perf_counter()
        while done < steps:
            for batch in loader:
                batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
                optimizer.zero_grad(set_to_none=True)
                loss = work.plain_loss(model, batch)
                loss.backward()
                if work.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), work.max_grad_norm)
                optimizer.step()
                done += 1
                if work.after_step:
                    work.after_step(model, done)
                running_loss += loss.item()
                if done == steps:
                    break
        synchronize(device)
        return (time.perf_counter() - start) / steps

    return timed


def synchronize(device: torch.device) -> None:
    """A round ends when the GPU's queued work is done (each step's loss.item() waits for its own step already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def toolkit_rounds(work: Workload, threads: int) -> tuple[Callable[[int], float], torch.device]:
    """The recipe's loop; returns a function timing `steps` steps (seconds per step), and the Accelerator's device."""
    workdir = Path(tempfile.mkdtemp(prefix="overhead-"))
    config = TrainConfig(
        output_dir=workdir / "run", log_with="none", epochs=10_000, batch_size=work.batch_size, threads=threads
    )
    run = start_run(config, recipe="overhead")
    accelerator = run.accelerator
    torch.manual_seed(0)
    model = work.make_model()
    optimizer = work.make_optimizer(model)
    pin = pin_memory(accelerator.device)
    if work.keyed_batches:
        batches = shuffled_batches(len(work.dataset), work.batch_size, seed=0, epochs=config.epochs)
        loader = DataLoader(work.dataset, batch_sampler=batches, collate_fn=work.collate_fn, pin_memory=pin)
    else:
        loader = DataLoader(
            work.dataset, batch_size=work.batch_size, shuffle=True, drop_last=True, collate_fn=work.collate_fn,
            pin_memory=pin,
        )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop = TrainingLoop(run, model, loader, evaluate=dict, main_metric="none")
    loop.start()
    epochs = loop.epochs()
    next(epochs)  # the loop's progress bar, as in a real run (never resumed: no evaluation or checkpoint at the end)
    batches = loop.batches()

    def timed(steps: int) -> float:
        nonlocal batches
        start = time.perf_counter()
        for _ in range(steps):
            try:
                batch = next(batches)
            except StopIteration:  # an epoch end, without the evaluation and checkpoint of a real one
                loop.progress.epoch += 1
                loop.progress.batches_done = 0
                batches = loop.batches()
                batch = next(batches)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss, value = work.recipe_loss(model, batch, loop, accelerator)
                accelerator.backward(loss)
                if work.max_grad_norm and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), work.max_grad_norm)
                optimizer.step()
                if work.after_step:
                    work.after_step(model, loop.progress.global_step + 1)
                optimizer.zero_grad(set_to_none=True)
            loop.record_loss(value)
        synchronize(accelerator.device)
        return (time.perf_counter() - start) / steps

    return timed, accelerator.device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="sasrec", help=f"one of {', '.join(RECIPES)}")
    parser.add_argument("--steps", type=int, help="optimizer steps per round and loop (default: by recipe)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, help="intra-op threads of this process (default: the recipe's)")
    parser.add_argument("--data", type=Path, help="dcrnn: a traffic data directory (default: generate one)")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/accelerate-recipes"))
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="instead: torch.profiler over this many of the recipe's steps, the top of the table")
    args = parser.parse_args()
    problems = []
    if args.recipe not in RECIPES:
        problems.append(f"--recipe {args.recipe} is unknown; use one of {', '.join(RECIPES)}")
    for name in ("steps", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            problems.append(f"--{name} {getattr(args, name)} is invalid; give an integer >= 1")
    if args.threads is not None and args.threads < 0:
        problems.append(f"--threads {args.threads} is invalid; give 0 (torch's default) or more")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        raise SystemExit(2)
    steps = args.steps or DEFAULT_STEPS[args.recipe]
    threads = DEFAULT_THREADS[args.recipe] if args.threads is None else args.threads
    cache_dir = args.cache_dir.expanduser()
    if args.recipe == "sasrec":
        work = sasrec_workload(cache_dir)
    elif args.recipe == "dcrnn":
        work = dcrnn_workload(args.data, cache_dir)
    elif args.recipe == "hrm":
        work = hrm_workload()
    else:
        work = ufs_workload()

    toolkit_round, device = toolkit_rounds(work, threads)  # first: start_run sets the process's threads for both
    if args.profile:  # where the recipe's step goes (ops by self CPU time), after a warm-up
        from torch.profiler import ProfilerActivity, profile

        toolkit_round(3)
        cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
        with profile(activities=[ProfilerActivity.CPU, *cuda]) as profiler:
            toolkit_round(args.profile)
        print(f"{args.recipe}: {args.profile} steps of the recipe's loop, batch {work.batch_size}; CPU: {cpu_kind()}")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40))
        return
    plain_round = plain_rounds(work, device)
    print(
        f"{args.recipe}: on {device}, batch {work.batch_size}, {args.rounds} rounds of {steps} steps; "
        f"CPU: {cpu_kind()}",
        flush=True,
    )
    plain_round(max(3, steps // 10)), toolkit_round(max(3, steps // 10))  # warm-up
    plain_times, toolkit_times = [], []
    for index in range(args.rounds):
        first, second = (plain_round, toolkit_round) if index % 2 == 0 else (toolkit_round, plain_round)
        a, b = first(steps), second(steps)
        plain_times.append(a if first is plain_round else b)
        toolkit_times.append(b if first is plain_round else a)
        print(
            f"round {index + 1}: plain {plain_times[-1] * 1e3:.3f} ms/step, toolkit {toolkit_times[-1] * 1e3:.3f} "
            f"ms/step, ratio {toolkit_times[-1] / plain_times[-1]:.3f}",
            flush=True,
        )
    plain, toolkit = statistics.median(plain_times), statistics.median(toolkit_times)
    ratios = [t / p for t, p in zip(toolkit_times, plain_times, strict=True)]
    print(f"median plain   {plain * 1e3:.3f} ms/step")
    print(f"median toolkit {toolkit * 1e3:.3f} ms/step (ratio of the medians {toolkit / plain:.3f})")
    # Each round's two sides ran back to back: the median of the rounds' ratios resists a load that drifts.
    print(
        f"ratio toolkit/plain = {statistics.median(ratios):.3f} (median of the rounds' ratios, "
        f"{min(ratios):.3f}-{max(ratios):.3f}; goal <= 1.05)"
    )


if __name__ == "__main__":
    main()
