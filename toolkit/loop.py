"""The bookkeeping of a training loop, written once: epochs, exact mid-epoch resume, step counting, per-step
reseeding, timing, progress bar, checkpoint cadence, evaluation rows, best-checkpoint tracking, the summary.

A recipe keeps the parts that are its own (forward, loss, backward, optimizer step, evaluation) and reads:

    loop = TrainingLoop(run, model, train_loader, main_metric="val_ndcg")
    loop.restore()                                   # after accelerator.prepare(...)
    for epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                loss = ...; accelerator.backward(loss); optimizer.step(); ...
            loop.record_loss(loss)
        loop.end_epoch(evaluate)
    summary = loop.finish(test)

Exact resume (bit-identical on CPU) needs: model/optimizer/scheduler/scaler state (Accelerate's save_state),
the sampler's order for the epoch (seedable sampler + set_epoch every epoch), the consumed batches skipped
(skip_first_batches), Accelerate's accumulation counter reset where the epoch restarts, dropout masks that do not
depend on the RNG history (the global RNG is reseeded from (seed, epoch, batch, rank) before each micro-batch), and
the loop's own counters (progress.json in the checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from toolkit import checkpoint, preemption
from toolkit.randomness import step_seed
from toolkit.run import Run
from toolkit.tracking import (
    LEADING_COLUMNS,
    LOG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    MetricsFile,
    plot_curves,
    truncate_after_step,
    write_json,
)


@dataclass
class Progress:
    """Where the loop is; saved in every checkpoint as progress.json."""

    run_id: str = ""
    epoch: int = 0  # epochs completed
    batches_done: int = 0  # micro-batches consumed in the current epoch
    global_step: int = 0  # optimizer steps
    samples_seen: int = 0
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    best_value: float | None = None
    best_step: int | None = None
    best_metrics: dict = field(default_factory=dict)
    last_metrics: dict = field(default_factory=dict)
    train_time_sec: float = 0.0


@dataclass
class _EpochTimer:
    started: float = field(default_factory=time.perf_counter)
    data_sec: float = 0.0
    compute_sec: float = 0.0
    samples: int = 0
    gpu_util: list = field(default_factory=list)


class TrainingLoop:
    def __init__(self, run: Run, model: torch.nn.Module, train_loader, *, main_metric: str,
                 higher_is_better: bool = True):
        self.run = run
        self.train_loader = train_loader
        self.steps_per_epoch = math.ceil(len(train_loader) / run.config.grad_accum)
        self.accelerator = run.accelerator
        self.config = run.config
        self.model = model
        self.main_metric = main_metric
        self.higher_is_better = higher_is_better
        self.progress = Progress(run_id=run.run_id)
        self.stopped = False  # --max-steps reached
        self._last_saved_step: int | None = None
        self._pending_loss: list[torch.Tensor] = []
        self._bar = None
        self._timer = _EpochTimer()
        self._run_started = time.perf_counter()

    # ---- resume -------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Load the resume checkpoint (if any) into the prepared objects and the loop. Call after prepare()."""
        if self.run.resume_checkpoint is None:
            return
        saved = checkpoint.load_checkpoint(self.accelerator, self.run.resume_checkpoint)
        known = {f.name for f in dataclasses.fields(Progress)}
        self.progress = Progress(**{k: v for k, v in saved.items() if k in known})
        self._last_saved_step = self.progress.global_step
        if self.run.is_main:  # rows a crashed life wrote after this checkpoint are written again
            for name in (METRICS_FILE, LOG_FILE):
                truncate_after_step(self.run.output_dir / name, self.progress.global_step)
        where = self.progress
        self.run.print(f"resumed at epoch {where.epoch}, batch {where.batches_done}, step {where.global_step}")

    # ---- iteration ----------------------------------------------------------------------------------------
    def epochs(self):
        cfg = self.config
        if self.run.is_main and self._bar is None:
            self._bar = tqdm(total=self.total_steps, initial=self.progress.global_step, unit="step",
                             dynamic_ncols=True, desc=self.run.recipe)
        while self.progress.epoch < cfg.epochs and not self.stopped:
            yield self.progress.epoch

    def batches(self):
        """Yield this epoch's micro-batches, continuing mid-epoch after a resume; stops at --max-steps."""
        accelerator, progress, cfg, loader = self.accelerator, self.progress, self.config, self.train_loader
        loader.set_epoch(progress.epoch)  # the sampler's order is a function of (data seed, epoch)
        iterable = accelerator.skip_first_batches(loader, progress.batches_done) if progress.batches_done else loader
        accelerator.step = 0  # Accelerate's accumulation counter: windows restart with the epoch, also on resume
        self._timer = _EpochTimer()
        psutil.cpu_percent()  # starts the CPU-utilisation window
        iterator = iter(iterable)
        while True:
            fetch_start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            compute_start = time.perf_counter()
            self._timer.data_sec += compute_start - fetch_start
            torch.manual_seed(step_seed(cfg.seed, progress.epoch * 1_000_003 + progress.batches_done,
                                        accelerator.process_index))
            yield batch
            progress.batches_done += 1
            progress.samples_seen += cfg.batch_size
            self._timer.samples += cfg.batch_size
            if accelerator.sync_gradients:
                progress.global_step += 1
                self._after_optimizer_step()
            self._timer.compute_sec += time.perf_counter() - compute_start
            if self.stopped:
                return

    def record_loss(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss, already the mean over the whole global batch (same value on every rank)."""
        self._pending_loss.append(loss.detach().float())

    def _after_optimizer_step(self) -> None:
        cfg, progress = self.config, self.progress
        losses = torch.stack(self._pending_loss).cpu() if self._pending_loss else torch.zeros(0)
        self._pending_loss.clear()
        progress.epoch_loss_sum += float(losses.sum())
        progress.epoch_loss_count += losses.numel()
        step_loss = float(losses.mean()) if losses.numel() else float("nan")
        if self._bar is not None:
            rate = self._timer.samples / max(time.perf_counter() - self._timer.started, 1e-9)
            self._bar.update(1)
            self._bar.set_postfix(epoch=progress.epoch, loss=f"{step_loss:.4f}", samples_per_s=f"{rate:.0f}")
        if progress.global_step % cfg.log_every == 0:
            self.accelerator.log({"train/loss": step_loss, "train/epoch": progress.epoch}, step=progress.global_step)
        if torch.cuda.is_available():
            self._timer.gpu_util.append(_gpu_utilisation())
        if preemption.requested_anywhere(self.accelerator):
            self._checkpoint_requeue_and_exit()
        if cfg.max_steps is not None and progress.global_step >= cfg.max_steps:
            self.stopped = True
        elif cfg.checkpoint_every and progress.global_step % cfg.checkpoint_every == 0:
            self.save()

    def _checkpoint_requeue_and_exit(self) -> None:
        """Pre-empted (SIGUSR1): a complete checkpoint of this step, requeue (main process), every rank exits 0."""
        self.save()
        if self.run.is_main:
            outcome = preemption.requeue_job(self.config.max_requeues)
            tqdm.write(f"pre-empted at step {self.progress.global_step}: checkpoint saved; {outcome}")
        self.accelerator.wait_for_everyone()
        if self._bar is not None:
            self._bar.close()
        self.accelerator.end_training()
        raise SystemExit(0)

    # ---- epoch end: evaluate, record, checkpoint ----------------------------------------------------------
    def end_epoch(self, evaluate) -> dict | None:
        """Close the epoch (or the stop at --max-steps): evaluate when due, write metrics.csv, checkpoint."""
        cfg, progress = self.config, self.progress
        completed = not self.stopped
        timer = self._timer
        epoch_time = time.perf_counter() - timer.started
        progress.train_time_sec += epoch_time
        train_loss = progress.epoch_loss_sum / progress.epoch_loss_count if progress.epoch_loss_count else None
        epoch_number = progress.epoch + 1  # 1-based, the epoch just trained (partly, if stopped)
        if completed:
            progress.epoch += 1
            progress.batches_done = 0
            progress.epoch_loss_sum, progress.epoch_loss_count = 0.0, 0
        last = self.stopped or progress.epoch >= cfg.epochs
        metrics = None
        new_best = False
        if last or (completed and progress.epoch % cfg.eval_every == 0):
            self.model.eval()
            with torch.no_grad():
                metrics = evaluate()
            self.model.train()
            new_best = self._update_best(metrics)
            progress.last_metrics = metrics
            util = [u for u in timer.gpu_util if u is not None]
            row = {
                "epoch": epoch_number,
                "step": progress.global_step,
                "train_loss": train_loss,
                **metrics,
                # Empty timings when nothing was trained since the resume (it resumed at this epoch's very end).
                "epoch_time_sec": round(epoch_time, 4) if timer.samples else None,
                "throughput_samples_per_sec": (round(timer.samples / max(epoch_time, 1e-9), 2)
                                               if timer.samples else None),
                "data_load_time_sec": round(timer.data_sec, 4) if timer.samples else None,
                "compute_time_sec": round(timer.compute_sec, 4) if timer.samples else None,
                "cpu_util_avg": psutil.cpu_percent(),
                "gpu_util_avg": round(sum(util) / len(util), 1) if util else None,
                "world_size": self.accelerator.num_processes,
            }
            if self.run.is_main:
                MetricsFile(self.run.output_dir).append(row)
                tqdm.write(" ".join(f"{k}={_short(v)}" for k, v in row.items() if k in metrics or k in LEADING_COLUMNS))
            self.accelerator.log({f"{k}": v for k, v in metrics.items()} | {"train/epoch_loss": train_loss or 0.0},
                                 step=progress.global_step)
        if last or new_best or (completed and cfg.checkpoint_every == 0):
            self.save()
        return metrics

    def _update_best(self, metrics: dict) -> bool:
        value = metrics[self.main_metric]
        best = self.progress.best_value
        better = best is None or (value > best if self.higher_is_better else value < best)
        if better:
            self.progress.best_value = value
            self.progress.best_step = self.progress.global_step
            self.progress.best_metrics = dict(metrics)
        return better

    def save(self) -> None:
        """A complete checkpoint of the current position (collective)."""
        step = self.progress.global_step
        if self._last_saved_step == step:
            return
        checkpoint.save_checkpoint(self.accelerator, self.run.output_dir, step, dataclasses.asdict(self.progress))
        self._last_saved_step = step
        protect = {self.progress.best_step} if self.progress.best_step is not None else set()
        checkpoint.prune_checkpoints(self.accelerator, self.run.output_dir, self.config.keep_checkpoints, protect)

    # ---- the end --------------------------------------------------------------------------------------------
    def finish(self, test=None, extra: dict | None = None) -> dict:
        """Load the best-validation weights, run `test` on them, write summary.json and curves.png, end trackers."""
        progress, run = self.progress, self.run
        if self._bar is not None:
            self._bar.close()
        best_checkpoint = None
        if progress.best_step is not None:
            best_checkpoint = checkpoint.checkpoints_root(run.output_dir) / f"step_{progress.best_step}"
            if progress.best_step != progress.global_step:
                self.load_weights(best_checkpoint)
        test_metrics = {}
        if test is not None:
            self.model.eval()
            with torch.no_grad():
                test_metrics = test()
        summary = {
            "recipe": run.recipe,
            "run_name": run.run_name,
            "global_step": progress.global_step,
            "epochs_completed": progress.epoch,
            "world_size": self.accelerator.num_processes,
            "final_metrics": progress.last_metrics,
            "best_step": progress.best_step,
            "best_metrics": progress.best_metrics,
            "best_checkpoint": str(best_checkpoint) if best_checkpoint else None,
            "test_metrics_at_best": test_metrics,
            "train_time_sec": round(progress.train_time_sec, 2),
            "wall_time_sec": round(time.perf_counter() - self._run_started, 2),
            **(extra or {}),
        }
        if run.is_main:
            write_json(run.output_dir / SUMMARY_FILE, summary)
            plot_curves(run.output_dir, self.main_metric)
        if test_metrics:
            self.accelerator.log({f"best/{k}": v for k, v in test_metrics.items()}, step=progress.global_step)
        self.accelerator.end_training()
        return summary

    def load_weights(self, checkpoint_dir: Path) -> None:
        state = load_file(str(Path(checkpoint_dir) / "model.safetensors"), device=str(self.accelerator.device))
        self.accelerator.unwrap_model(self.model).load_state_dict(state)

    @property
    def total_steps(self) -> int | None:
        total = self.steps_per_epoch * self.config.epochs
        return min(total, self.config.max_steps) if self.config.max_steps is not None else total


def _short(value):
    return f"{value:.4f}" if isinstance(value, float) else value


def _gpu_utilisation() -> float | None:
    try:
        return float(torch.cuda.utilization())
    except Exception:  # needs pynvml / NVML; the column stays empty without it
        return None
