"""DCRNN traffic speed forecasting: 12 readings (1 hour) in, the next 12 out, on a road graph.

Runs unchanged on one CPU, several CPU processes (gloo), 1-8 GPUs and several nodes:

    python -m toolkit.data.traffic synth --out data/synth-la --sensors 50 --days 28
    python recipes/dcrnn.py --data data/synth-la                              # CPU preset, minutes on 2 cores
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/dcrnn.py --data data/synth-la
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/dcrnn.py --preset metr-la --data METR-LA

Features: --data is a directory with a pandas HDF5 speed table (metr-la.h5, timestamps x sensors, mph, 0 = missing) and
the adjacency pickle adj_mx.pkl ([sensor_ids, id_to_index, matrix]); the timeline is split 70/10/20 in time and windows
never cross a boundary; inputs are speed (standardised with the training inputs' mean/std) and time of day.
Encoder-decoder of diffusion-convolution GRU cells (dual random walk, K steps); scheduled sampling with inverse-sigmoid
decay, the coin of each (window, decoder step) keyed by (seed, step, window), so any process count and any resume draw
the same coins; gradient clipping; Adam with step decay. --sequence-kernel: the whole sequence fused into one autograd
function (a third of the kernel launches; `auto` takes it on CUDA) or a cell step at a time (`auto` on CPU). Loss and
metrics are masked (missing readings left out) and in mph after undoing the scaling: MAE, RMSE, MAPE overall and at
15/30/60 minutes, gathered with gather_for_metrics. Test metrics of the best-validation checkpoint and the two
baselines on the same test windows (historical average of the same slot of the week, last observed value) go into
summary.json.
Presets (--preset): `cpu` (default: small model, minutes on a laptop CPU) and `metr-la` (the paper's settings: 2 layers
of 64 units, K=2, batch 64, lr 0.01 decayed x0.1 at epochs 20/30/40/50, clip 5, 100 epochs, decay steps 2000);
flags given with a preset override its values.

Errors (one line, exit 2, before anything is written): no --data, a --data directory without exactly one .h5 table and
one adj*.pkl, a table that is not pandas HDF5, has no time index, irregular timestamps, non-numeric or negative
speeds, or fewer timesteps than one window per part; an adjacency that is not [ids, index, matrix], whose size or ids
disagree with the table; out-of-range numbers; --sequence-kernel fused with --compile or with --kernels plain;
--batch-size not divisible by the process count or larger than the training windows; and the shared flags' errors
(fp16 on CPU, bad --resume-from, --output-dir in use...).
"""

from __future__ import annotations

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before anything heavy: SIGUSR1 (pre-emption) only sets a flag from here on; OpenMP's policy

# isort: split
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader

from toolkit import (
    Run,
    TrainConfig,
    TrainingLoop,
    UsageError,
    device_batches,
    format_table,
    global_mean,
    keyed_uniform,
    main_process_first,
    make_optimizer,
    masked_error_sums,
    model_line,
    one_line_errors,
    parse_config,
    pin_memory,
    require_at_least,
    require_batch_fits,
    require_range,
    shuffled_batches,
    start_run,
)
from toolkit.data.traffic import (
    OUTPUT_STEPS,
    baseline_metrics,
    data_warnings,
    horizon_metrics,
    prepare_traffic,
    split_windows,
)
from toolkit.kernels import dcrnn as dcrnn_kernels
from toolkit.models.dcrnn import DCRNN, sampling_probability

TEACHER_COINS = 3  # purpose of the keyed scheduled-sampling coins


@dataclass
class DCRNNConfig(TrainConfig):
    """DCRNN on a road graph; the defaults are the `cpu` preset's (PRESETS below)."""

    # Flags added after runs were made: a run whose config.json lacks one resumes with this value (not a flag). Runs
    # before --sequence-kernel computed DCRNN cell by cell: resuming one asks for `--sequence-kernel cells` (auto:
    # fused on CUDA)
    added_flags = {"sequence_kernel": "cells"}

    data: Path | None = None
    """Directory holding the speed table (*.h5, e.g. metr-la.h5) and the adjacency pickle (adj*.pkl)."""
    cache_dir: Path = Path("~/.cache/accelerate-recipes")
    """Where the processed table is cached (`datasets`)."""
    max_speed: float = 200.0
    """Speeds above this (mph) are refused as a damaged table; widen it for data in other units."""
    units: int = 16
    """Hidden units of each DCGRU cell."""
    layers: int = 2
    """Stacked DCGRU cells in the encoder and in the decoder."""
    diffusion_steps: int = 2
    """K: diffusion steps per random-walk support."""
    sampling_decay_steps: float = 80.0
    """Scheduled sampling: the decoder gets the true value with probability k / (k + exp(step / k)); 0 = never."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (eps 1e-3, as the reference code) or plain SGD."""
    lr_decay_epochs: tuple[int, ...] = (4,)
    """Multiply the learning rate by --lr-decay at these epochs (step decay)."""
    lr_decay: float = 0.1
    """Step-decay factor."""
    epochs: int = 6
    batch_size: int = 64
    lr: float = 0.01
    max_grad_norm: float = 5.0
    threads: int = 1  # this model's products are small: more threads gain little and, on a busy machine, stall
    sequence_kernel: Literal["auto", "fused", "cells"] = "auto"
    """How the model's forward and backward run (the same function up to rounding): `fused`, the whole sequence as
    one autograd function with a hand-written backward (~930 kernels an optimizer step instead of ~3,000); `cells`,
    a DCGRU cell step at a time under autograd; `auto`, fused on CUDA and cells on CPU (where the cells are faster)
    and under --compile (which traces the cells). The fused kernel is a fast path (toolkit/kernels/dcrnn.py), so it
    runs under --kernels auto only; --kernels plain trains the cells. A resume keeps the run's value."""

    captures_whole_step = True  # its step runs through loop.run_step (--cuda-graphs: one CUDA graph)


# --preset NAME (toolkit.run.presets): the first is the default; any flag given overrides the preset's value.
PRESETS = {
    "cpu": ("a small DCRNN that trains in minutes on 2 CPU cores on a generated 50-sensor network", DCRNNConfig()),
    "metr-la": (
        "the published settings (Li et al. 2018, the reference code's dcrnn_la.yaml)",
        DCRNNConfig(units=64, sampling_decay_steps=2000.0, lr_decay_epochs=(20, 30, 40, 50), epochs=100, threads=0),
    ),
}


def check(cfg: DCRNNConfig) -> None:
    """Recipe-specific checks, before anything is built."""
    if cfg.data is None:
        raise UsageError(
            "--data is missing; give a directory with metr-la.h5 and adj_mx.pkl (make one with "
            "`python -m toolkit.data.traffic synth --out data/synth-la --sensors 50 --days 28`)"
        )
    require_at_least(cfg, 1, "units", "layers", "diffusion_steps")
    if not 0 <= cfg.sampling_decay_steps < float("inf"):
        raise UsageError(
            f"--sampling-decay-steps {cfg.sampling_decay_steps} is invalid; give a finite number >= 0 "
            "(0 = no scheduled sampling)"
        )
    if not (cfg.max_speed > 0 and math.isfinite(cfg.max_speed)):
        raise UsageError(f"--max-speed {cfg.max_speed} is invalid; give a finite speed > 0 (mph)")
    require_range(cfg, "(0, 1]", "lr_decay")
    if cfg.sequence_kernel == "fused" and (cfg.compile or cfg.cuda_graphs):
        flag = "--cuda-graphs" if cfg.cuda_graphs else "--compile"
        # (--cuda-graphs: the fused kernel reuses buffers it keeps in Python between steps, which a replay would not)
        what = ("captured (--cuda-graphs captures the cells)" if cfg.cuda_graphs
                else "compiled (--compile traces the cells)")
        raise UsageError(f"--sequence-kernel fused cannot be {what}; give "
                         f"--sequence-kernel auto or cells with {flag}, or leave {flag} out")
    if cfg.sequence_kernel == "fused" and cfg.kernels == "plain":
        raise UsageError("--sequence-kernel fused is a fast path (toolkit/kernels/dcrnn.py) that --kernels plain "
                         "leaves out; give --kernels auto with it, or --sequence-kernel cells or auto with "
                         "--kernels plain")
    if any(epoch < 1 for epoch in cfg.lr_decay_epochs):
        raise UsageError(f"--lr-decay-epochs {' '.join(map(str, cfg.lr_decay_epochs))} is invalid; give epochs >= 1")


def masked_mae(scaled_prediction: torch.Tensor, truth: torch.Tensor, scaler, accelerator):
    """The objective trained on: MAE in mph over the readings present (0 = missing), meaned over the GLOBAL batch."""
    predicted = scaler.inverse(scaled_prediction.float())
    observed = truth > 0  # missing readings are 0: left out of the loss
    error_sum = torch.where(observed, (predicted - truth).abs(), torch.zeros_like(predicted)).sum()
    return global_mean(accelerator, error_sum, observed.sum())  # (loss to backpropagate, its value)


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PRESETS, argv, description=__doc__, check=check)
    # The graph supports are constants on every rank: no need for DDP to broadcast them every forward.
    with start_run(cfg, recipe="dcrnn", ddp_kwargs={"broadcast_buffers": False}) as run:
        return train(run, cfg)


def train(run: Run, cfg: DCRNNConfig) -> dict:
    accelerator = run.accelerator

    # ---- data: read, checked and cached by the main process, loaded from the cache by the others -------------
    prepared = main_process_first(run, lambda: prepare_traffic(cfg.data, cfg.cache_dir.expanduser(), cfg.max_speed))
    table, meta = prepared
    split = split_windows(table)
    prepared.describe(run, sensors=meta["num_sensors"], timesteps=meta["num_timesteps"])
    minutes = meta["interval_minutes"]
    loader_args = dict(
        batch_size=cfg.batch_size, num_workers=cfg.num_workers, pin_memory=pin_memory(accelerator.device)
    )
    require_batch_fits(cfg.batch_size, len(split.train), "training windows")
    # Full global batches only (N processes and one process take identical steps), each epoch a keyed permutation;
    # on the device, cut there per rank (toolkit.run.device_data); a set too large for it goes through a DataLoader.
    batches = shuffled_batches(len(split.train), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs)
    train_loader = device_batches(run, split.train, batches, num_workers=cfg.num_workers,
                                  pin_memory=pin_memory(accelerator.device))
    valid_loader = DataLoader(split.valid, shuffle=False, **loader_args)
    test_loader = DataLoader(split.test, shuffle=False, **loader_args)
    run.print(
        f"data: {meta['num_sensors']} sensors, {meta['num_timesteps']} timesteps every {minutes:g} min "
        f"({meta['missing_fraction']:.1%} missing); windows train/val/test {len(split.train)}/"
        f"{len(split.valid)}/{len(split.test)}; speed mean {split.scaler.mean:.2f} std {split.scaler.std:.2f} "
        f"mph (training inputs)"
    )
    for line in data_warnings(split.speed, meta, batches=len(train_loader), grad_accum=cfg.grad_accum,
                              batch_size=cfg.batch_size):
        run.print(line)  # once, from the main process; the run goes on
    baselines = baseline_metrics(split, split.test, "test", minutes)  # cheap, the same on every rank

    # ---- model and optimisation ----------------------------------------------------------------------------
    model = DCRNN(
        meta["adjacency"],
        input_dim=2,
        output_dim=1,
        units=cfg.units,
        layers=cfg.layers,
        diffusion_steps=cfg.diffusion_steps,
        horizon=OUTPUT_STEPS,
        sequence_kernel="cells" if cfg.cuda_graphs else cfg.sequence_kernel,  # (a captured step: the cells)
    )
    # --kernels auto: the fast paths swapped in (toolkit/kernels/dcrnn.py), proven on two training windows at the
    # model's sizes, called as the step calls it: with teacher values and coins, the truth fed back at every other
    # decoder step (each sample on the other steps), so both of the decoder's branches run
    two = [split.train[i] for i in (0, len(split.train) - 1)]
    x, truth = (torch.stack([w[key] for w in two]).to(accelerator.device) for key in ("x", "y"))
    horizons = torch.arange(OUTPUT_STEPS, device=accelerator.device)
    coins = (horizons[None, :] + torch.arange(2, device=accelerator.device)[:, None]) % 2 == 0
    model = run.with_kernels(model, lambda m: m(x, split.scaler.transform(truth), coins))
    # the kernel this run's forwards take: the model file's cells without the fast path (--kernels plain), and when
    # compiled (traced) or captured; auto's choice depends on the device
    fast = isinstance(model, dcrnn_kernels.DCRNN) and not (cfg.compile or cfg.cuda_graphs)
    kernel = model.kernel_for(accelerator.device) if fast else "cells"
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr, eps=1e-3)  # the reference's eps
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)  # as the loop counts them
    milestones = [epoch * steps_per_epoch for epoch in cfg.lr_decay_epochs]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=cfg.lr_decay)
    model, optimizer, scheduler, valid_loader, test_loader = accelerator.prepare(
        model, optimizer, scheduler, valid_loader, test_loader
    )
    scaler = split.scaler
    run.print(model_line(f"DCRNN {cfg.layers}x{cfg.units}, K={cfg.diffusion_steps}, {kernel} sequence kernel", model))

    def forecast_metrics(loader, prefix):
        """Masked errors in mph per horizon; every window counted once (gather_for_metrics drops the padding)."""
        sums = torch.zeros(OUTPUT_STEPS, 5, dtype=torch.float64)
        for batch in loader:
            with accelerator.autocast():
                predicted = model(batch["x"])
            per_window = masked_error_sums(scaler.inverse(predicted.float()), batch["y"], keep_dims=(0, 1))
            sums += accelerator.gather_for_metrics(per_window).sum(dim=0).cpu()  # [windows, horizon, 5] -> sums
        metrics = horizon_metrics(sums, prefix, minutes)
        metrics[f"{prefix}_readings"] = int(sums[:, 3].sum())  # readings scored: each window's, counted once
        # {prefix}_loss: the training objective, masked MAE in mph over every horizon (so it equals {prefix}_mae)
        return {f"{prefix}_loss": metrics[f"{prefix}_mae"], **metrics}

    loop = TrainingLoop(
        run,
        model,
        train_loader,
        evaluate=lambda: forecast_metrics(valid_loader, "val"),
        main_metric="val_mae",
        higher_is_better=False,
    )

    def teacher_forcing(batch) -> dict:
        """The batch with this step's scheduled-sampling values as tensors on the device (the step and the
        probability of the truth, computed on the host as the reference does): a captured step replays tensors."""
        if not cfg.sampling_decay_steps:
            return batch
        step, device = loop.global_step, batch["y"].device
        probability = sampling_probability(step, cfg.sampling_decay_steps)
        return {**batch, "step": torch.full((), step, dtype=torch.int64, device=device),
                "teacher_probability": torch.full((), probability, dtype=torch.float64, device=device)}

    def training_loss(batch):
        truth = batch["y"]
        use_teacher = None
        if cfg.sampling_decay_steps:
            horizons = torch.arange(OUTPUT_STEPS, device=truth.device)[None, :]
            coins = keyed_uniform(cfg.seed, TEACHER_COINS, batch["step"], batch["window"][:, None], horizons)
            use_teacher = coins < batch["teacher_probability"]
        return masked_mae(model(batch["x"], scaler.transform(truth), use_teacher), truth, scaler, accelerator)

    def train_step(batch):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss, loss_value = training_loss(batch)
            accelerator.backward(loss)
            loop.optimizer_step(optimizer, scheduler, loss=loss_value)

    # ---- train: the loop takes the run directory and resumes; it evaluates and checkpoints when due ----------
    loop.start()
    for _epoch in loop.epochs():
        for batch in loop.batches():
            loop.run_step(train_step, teacher_forcing(batch))  # --cuda-graphs: captured once, replayed
        loop.end_epoch()

    # ---- test the best validation checkpoint, next to the baselines on the same windows -----------------------
    summary = loop.finish_at_best(lambda: forecast_metrics(test_loader, "test"), extra={"baselines": baselines})
    for name, metrics in baselines.items():
        run.print(format_table(f"baseline {name} on the same test windows", metrics))
    return summary


if __name__ == "__main__":
    main()
