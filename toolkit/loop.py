"""The bookkeeping of a training loop, written once: epochs, exact mid-epoch resume, step counting, per-step
reseeding, timing, progress bar, evaluation and checkpoint cadence, best-checkpoint tracking, early stopping,
non-finite guards, the summary.

A recipe keeps the parts that are its own (forward, loss, evaluation) and reads:

    loop = TrainingLoop(run, model, train_loader, evaluate=validate, main_metric="val_ndcg",
                        state={"scaler": scaler}, rank_state={"carry": carry})
    loop.start()                                     # after accelerator.prepare(...): takes the run dir, resumes
    for epoch in loop.epochs():
        for batch in loop.batches():                 # may evaluate and checkpoint between steps (cadence)
            with accelerator.accumulate(model):
                loss, loss_value = ...; accelerator.backward(loss)
                loop.optimizer_step(optimizer, scheduler, loss=loss_value)   # clip, step, zero, record
        metrics = loop.end_epoch()                   # evaluates and checkpoints when due
        if should_stop(metrics): loop.request_stop("no improvement for 5 evaluations")
    return loop.finish_at_best(run_test)             # best weights, test, summary.json, trackers and group end

(or loop.load_best(); loop.test(run_test); exports, Jacobians etc. with grad; loop.finish()). Its parts live in
their own modules: toolkit.cadence (when to evaluate and save), toolkit.agreement (what the ranks decide together),
toolkit.meter (timing, utilisation, the progress bar, a row's measured columns), toolkit.checkpoint (the files).

Cadence: evaluations every --eval-every epochs, or every --eval-every-steps optimizer steps; checkpoints every
--checkpoint-every steps (else at each epoch end), always AFTER the evaluation of the same step, and at the end.
When the loop ends (epochs done, --max-steps, request_stop) the final step is evaluated and saved once.

Exact resume (bit-identical on CPU) needs: model/optimizer/scheduler/scaler state (Accelerate's save_state),
the recipe's extra state, the sampler's order for the epoch (seedable sampler + set_epoch every epoch), the
consumed batches skipped (skip_first_batches), Accelerate's accumulation counter reset where the epoch restarts,
randomness that does not depend on the RNG history (keyed dropout; the global RNG reseeded from (seed, epoch,
batch, rank) before each micro-batch), and the loop's own counters (progress.json, which also records how long
metrics.csv and log.csv were, so a resume cuts off exactly what was written after the checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from toolkit import checkpoint, compilation, extras, preemption, randomness, shutdown
from toolkit.agreement import agree
from toolkit.cadence import epoch_end_save_due, evaluation_due, mid_epoch_save_due
from toolkit.distributed import mean_over_processes
from toolkit.errors import TrainingStopped, UsageError
from toolkit.keeper import CheckpointKeeper
from toolkit.meter import StepMeter
from toolkit.randomness import reseed_global_rng, step_seed
from toolkit.run import Run
from toolkit.rundir import METRICS_FILE, SUMMARY_FILE
from toolkit.tracking import (
    LEADING_COLUMNS,
    MetricsFile,
    format_table,
    plot_curves,
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
    interval_loss_sum: float = 0.0  # training loss since the last metrics row
    interval_loss_count: int = 0
    best_value: float | None = None
    best_step: int | None = None
    best_metrics: dict = field(default_factory=dict)
    last_metrics: dict = field(default_factory=dict)
    last_eval_step: int | None = None
    stop_reason: str | None = None  # request_stop(reason): the run ended early
    train_time_sec: float = 0.0
    wall_time_sec: float = 0.0  # wall time of the work this checkpoint keeps, summed over the run's lives
    file_bytes: dict = field(default_factory=dict)  # metrics.csv / log.csv sizes when this checkpoint was saved
    first_loss: float | None = None  # the first step's training loss: --max-loss-ratio compares against it


def total_training_steps(config, batches_per_epoch: int | Callable[[int], int]) -> int:
    """Optimizer steps the run will take: --epochs x steps per epoch, capped by --max-steps (for LR schedules).
    batches_per_epoch: a number, or a function of the epoch when epochs differ (toolkit.sampler)."""
    if callable(batches_per_epoch):
        total = sum(math.ceil(batches_per_epoch(epoch) / config.grad_accum) for epoch in range(config.epochs))
    else:
        total = math.ceil(batches_per_epoch / config.grad_accum) * config.epochs
    return min(total, config.max_steps) if config.max_steps is not None else total


# Callables hook(loop) run after every optimizer step, once the loop has done its own work for it (logged, evaluated,
# saved when due): for tools and tests that must act at an exact step (fault injection: stop or kill the process
# right after step N is logged; profilers). Append to it before the loop runs; the recipes never use it.
AFTER_STEP_HOOKS: list[Callable[[TrainingLoop], None]] = []


def rest_of_epoch(accelerator, loader, batches_done: int):
    """The micro-batches of the current epoch after the first `batches_done` (a resume mid-epoch): with the
    sampler's epoch set, they are exactly the ones an uninterrupted run takes next."""
    return accelerator.skip_first_batches(loader, batches_done) if batches_done else loader


def require_whole_epoch(batches_done: int, batches_in_epoch: int, epoch: int) -> None:
    """The loader ran out: it must have given the whole epoch. Short of it, end_epoch() would never close the epoch
    and the loop would ask for the same (empty) rest of it forever; one line instead."""
    if batches_done < batches_in_epoch:
        raise TrainingStopped(
            f"the training data of epoch {epoch + 1} ended after {batches_done} of its {batches_in_epoch} batches: "
            "the resume position or the loader's length is wrong, so the run could never reach its end; the "
            "checkpoints are kept (report this with the run's config.json)"
        )


class TrainingLoop:
    def __init__(self, run: Run, model: torch.nn.Module, train_loader, *, evaluate, main_metric: str,
                 higher_is_better: bool = True, state: dict | None = None, rank_state: dict | None = None,
                 batches_per_epoch: Callable[[int], int] | None = None):
        """evaluate(): validation metrics {name: number} (called under no_grad, model in eval mode; must return the
        same values on every rank, e.g. from gather_for_metrics). state / rank_state: {name: object with
        state_dict/load_state_dict} saved in every checkpoint, once (shared) or per rank (e.g. a carry).
        batches_per_epoch(epoch): for a loader whose epochs differ in length (toolkit.sampler.CrossEpochBatchSampler;
        len(loader) is then the current epoch's), so the run's step count is right; default len(train_loader)."""
        self.run = run
        self.train_loader = train_loader
        self.steps_per_epoch = math.ceil(len(train_loader) / run.config.grad_accum)
        self.accelerator = run.accelerator
        self.config = run.config
        self.model = model
        self.evaluate_fn = evaluate
        self.main_metric = main_metric
        self.higher_is_better = higher_is_better
        self.shared_state = dict(state or {})
        self.rank_state = dict(rank_state or {})
        self.batches_per_epoch = batches_per_epoch
        self.progress = Progress(run_id=run.run_id)
        self.stopped = False  # --max-steps reached or a stop requested: the epoch loop ends
        self._stop_request: str | None = None
        self._save_due = False  # an epoch end asked for a checkpoint (written after the epoch's body)
        self.keeper = CheckpointKeeper(run, model, self.shared_state, self.rank_state)
        self._pending_loss: list[torch.Tensor] = []
        self.meter = StepMeter(self.accelerator.device, show_bar=run.is_main)
        self._test_metrics: dict = {}
        self._run_started = self._wall_mark = time.perf_counter()  # this life; wall time not yet in progress
        self._compile_report = compilation.first_step_reporter(run)  # --compile: its cost, once a life
        plain_dropout = randomness.rank_dependent_dropout_line(model)
        if plain_dropout:
            run.print(plain_dropout)

    # ---- start: take the run directory, resume ----------------------------------------------------------------
    def start(self) -> None:
        """Take the run directory (lock, config.json, trackers), then load the resume checkpoint (if any) into the
        prepared objects, the extra state and the loop. Call after prepare()."""
        run = self.run
        if run.resume_checkpoint is not None and self.rank_state and run.previous is not None:
            before = run.previous.get("world_size")
            if before != self.accelerator.num_processes:
                raise UsageError(
                    f"--resume-from {run.resume_checkpoint}: this recipe keeps per-rank state "
                    f"({', '.join(self.rank_state)}), so it resumes only with the run's {before} process(es), not "
                    f"{self.accelerator.num_processes}"
                )
        run.begin()
        saved = self.keeper.resume()
        if saved is None:
            return
        known = {f.name for f in dataclasses.fields(Progress)}
        self.progress = Progress(**{k: v for k, v in saved.items() if k in known})
        where = self.progress
        run.print(f"resumed at epoch {where.epoch}, batch {where.batches_done}, step {where.global_step}")

    # ---- iteration ----------------------------------------------------------------------------------------
    def epochs(self):
        """Yield epoch numbers until --epochs, --max-steps or a stop request; then evaluate and save the end."""
        cfg = self.config
        if not self.run.begun:
            raise RuntimeError("call loop.start() before iterating loop.epochs()")
        self.meter.open_bar(self.total_steps, self.progress.global_step, self.run.recipe)
        if self.progress.stop_reason:
            self.stopped = True
        if cfg.max_steps is not None and self.progress.global_step >= cfg.max_steps:
            self.stopped = True  # resumed at or past --max-steps: no step beyond it
        while self.progress.epoch < cfg.epochs and not self.stopped:
            yield self.progress.epoch
            if agree(self.accelerator, stop=self._stop_request is not None).stop and not self.stopped:
                self._take_stop_request()
            if self._save_due:
                self.save()
                self._save_due = False
        self._final_evaluation_and_save()
        randomness.end_micro_batches()

    def batches(self):
        """Yield this epoch's micro-batches, continuing mid-epoch after a resume; stops at --max-steps."""
        accelerator, progress, cfg, loader = self.accelerator, self.progress, self.config, self.train_loader
        loader.set_epoch(progress.epoch)  # the sampler's order is a function of (data seed, epoch)
        iterable = rest_of_epoch(accelerator, loader, progress.batches_done)
        accelerator.step = 0  # Accelerate's accumulation counter: windows restart with the epoch, also on resume
        self.meter.begin_epoch()
        iterator = iter(iterable)
        while True:
            fetch_start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                require_whole_epoch(progress.batches_done, len(loader), progress.epoch)
                return
            compute_start = time.perf_counter()
            self.meter.fetched(compute_start - fetch_start)
            key = progress.epoch * 1_000_003 + progress.batches_done
            reseed_global_rng(step_seed(cfg.seed, key, accelerator.process_index))
            randomness.begin_micro_batch(cfg.seed, key, accelerator.process_index, accelerator.num_processes)
            yield batch
            progress.batches_done += 1
            progress.samples_seen += cfg.batch_size
            self.meter.computed(cfg.batch_size, time.perf_counter() - compute_start)
            if accelerator.sync_gradients:
                progress.global_step += 1
                self._after_optimizer_step(end_of_epoch=progress.batches_done >= len(loader))
                for hook in AFTER_STEP_HOOKS:
                    hook(self)
            if self.stopped:
                return

    def optimizer_step(self, optimizer, scheduler=None, *, loss: torch.Tensor | None = None,
                       rank_loss: torch.Tensor | None = None) -> None:
        """The step every recipe takes, once: inside `with accelerator.accumulate(model):`, after
        `accelerator.backward(...)`. Clips the gradients to --max-grad-norm when they sync (the last micro-batch of
        an accumulation window), steps the optimizer and the scheduler (Accelerate skips both inside a window), zeroes
        the gradients, and records the micro-batch's loss for the progress bar, log and metrics rows. Give either
        `loss`, already the mean over the GLOBAL batch (toolkit.distributed.global_mean returns it), or
        `rank_loss`, this rank's mean over its equal share of the batch, averaged over the processes here."""
        if (loss is None) == (rank_loss is None):
            raise TypeError("optimizer_step: give exactly one of loss= (the global batch's mean) or rank_loss= "
                            "(this rank's mean, averaged over the processes here)")
        accelerator = self.accelerator
        if self.config.max_grad_norm and accelerator.sync_gradients:
            accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.record_loss(loss if rank_loss is None else mean_over_processes(accelerator, rank_loss.detach()))

    def record_loss(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss, already the mean over the whole GLOBAL batch (the same value on every rank): a
        rank's own mean must be averaged first (toolkit.distributed.mean_over_processes), or use optimizer_step's
        rank_loss=, which does it. For a step that optimizer_step does not fit (HRM's two optimizers)."""
        self._pending_loss.append(loss.detach().float())

    def request_stop(self, reason: str) -> None:
        """End the run early (e.g. early stopping): at the next step boundary or epoch end every rank stops, the
        final step is evaluated and checkpointed, and `reason` goes into summary.json."""
        self._stop_request = reason

    def _take_stop_request(self) -> None:
        self.progress.stop_reason = self._stop_request or "stop requested on another rank"
        self.stopped = True
        self.run.print(f"stopping at step {self.progress.global_step}: {self.progress.stop_reason}")

    def _after_optimizer_step(self, end_of_epoch: bool) -> None:
        cfg, progress = self.config, self.progress
        # Python floats: one device-to-host copy per micro-batch and no small tensors (a few us each, every step)
        losses = [float(loss) for loss in self._pending_loss]
        self._pending_loss.clear()
        step_loss = sum(losses) / len(losses) if losses else float("nan")
        if self._compile_report is not None:  # --compile: the first step's compute, said once (toolkit/compilation.py)
            self._compile_report = self._compile_report(self.meter.timer.compute_sec)
        if progress.first_loss is None and math.isfinite(step_loss):
            progress.first_loss = step_loss
        ratio = cfg.max_loss_ratio
        exploded = bool(ratio) and math.isfinite(step_loss) and abs(step_loss) > ratio * abs(progress.first_loss)
        agreed = agree(self.accelerator, preempted=preemption._requested,
                       diverged=not math.isfinite(step_loss) or exploded, stop=self._stop_request is not None)
        preempted, diverged, stop = agreed.preempted, agreed.diverged, agreed.stop
        if diverged:
            if math.isfinite(step_loss) and exploded:
                self._diverged(f"the training loss exploded to {step_loss:.4g} at step {progress.global_step}, more "
                               f"than --max-loss-ratio {ratio:g} x the first step's {progress.first_loss:.4g}")
            self._diverged(f"the training loss is {step_loss} at step {progress.global_step}")
        progress.interval_loss_sum += sum(losses)
        progress.interval_loss_count += len(losses)
        self.meter.stepped(progress.epoch, step_loss)
        if progress.global_step % cfg.log_every == 0:
            self.accelerator.log({"train/loss": step_loss, "train/epoch": progress.epoch}, step=progress.global_step)
        if preempted:
            self._checkpoint_requeue_and_exit()
        if stop:
            self._take_stop_request()
        if cfg.max_steps is not None and progress.global_step >= cfg.max_steps:
            self.stopped = True
        if self.stopped or end_of_epoch:
            return  # the epoch end / the loop's end evaluates and saves this step
        new_best = False
        if cfg.eval_every_steps and self._evaluation_due():
            self._evaluate_and_record()
            if agree(self.accelerator, stop=self._stop_request is not None).stop:  # e.g. early stopping in evaluate()
                self._take_stop_request()
                return  # the loop's end saves this step, with the stop reason in it
            new_best = progress.best_step == progress.global_step  # mid-epoch: load_best() needs its checkpoint
        if mid_epoch_save_due(cfg.checkpoint_every, progress.global_step, new_best):
            self.save()

    def _checkpoint_requeue_and_exit(self) -> None:
        """Pre-empted (SIGUSR1): a complete checkpoint of this step, requeue (main process), every rank exits 0."""
        self.save()
        if self.run.is_main:
            step = self.progress.global_step

            def announce(what: str) -> None:  # flushed: the requeue may end this process right after
                tqdm.write(f"pre-empted at step {step}: checkpoint saved; {what}")
                sys.stdout.flush()

            preemption.requeue_job(self.config.max_requeues, announce)
        self.meter.close_bar()
        shutdown.end_process_group(self.accelerator)  # all ranks leave together
        raise SystemExit(0)

    def _diverged(self, what: str) -> None:
        progress = self.progress
        kept = checkpoint.newest_complete(self.run.output_dir)
        best = f"step_{progress.best_step}" if progress.best_step is not None else "none yet"
        self.meter.close_bar()
        raise TrainingStopped(
            f"{what}: the run stopped without saving this step; the last good checkpoint "
            f"({kept.name if kept else 'none'}) and the best one ({best}) are kept and no result is reported; "
            "lower --lr or check the data"
        )

    # ---- epoch end: evaluate, record, checkpoint ----------------------------------------------------------
    def end_epoch(self) -> dict | None:
        """Close the epoch: evaluate when due (--eval-every epochs, or --eval-every-steps; always at the last
        epoch) and mark a checkpoint due; it is written when the epoch's body is over, so a stop requested after
        this evaluation is in it. Returns the metrics when it evaluated. Stopped mid-epoch: the loop's end does it."""
        cfg, progress = self.config, self.progress
        if progress.batches_done < len(self.train_loader):
            return None
        progress.epoch += 1
        progress.batches_done = 0
        step = progress.global_step
        last = self.stopped or progress.epoch >= cfg.epochs
        due = self._evaluation_due()
        metrics = self._evaluate_and_record(scheduled=due) if due or last else None
        new_best = metrics is not None and progress.best_step == step
        self._save_due = epoch_end_save_due(cfg.checkpoint_every, step, new_best, last)
        return metrics

    def _final_evaluation_and_save(self) -> None:
        if self.progress.last_eval_step != self.progress.global_step:
            self._evaluate_and_record(scheduled=self._evaluation_due())
        self.save()

    def _evaluation_due(self) -> bool:
        cfg, progress = self.config, self.progress
        return evaluation_due(cfg.eval_every_steps, cfg.eval_every, progress.global_step, progress.epoch,
                              progress.batches_done)

    def _evaluate_and_record(self, scheduled: bool = True) -> dict:
        """Evaluate, refuse non-finite metrics, update the best, write the metrics.csv row, log.

        The row's train_loss is the mean since the previous scheduled evaluation; an unscheduled one (the end of a
        run stopped by --max-steps or a request) does not restart that mean, so a run resumed past it writes the
        rows an uninterrupted run writes."""
        progress = self.progress
        # The row's interval is the training since the last row (its steps, and the checkpoint saved after that
        # row): read before evaluating, so epoch_time_sec and throughput leave the evaluation out.
        interval = self.meter.interval_seconds()
        self.model.eval()
        with torch.no_grad():
            metrics = self.evaluate_fn()
        self.model.train()
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            self._diverged(f"the validation metric {bad[0]} is {metrics[bad[0]]} at step {progress.global_step}")
        self._update_best(metrics)
        progress.last_metrics = metrics
        progress.last_eval_step = progress.global_step
        train_loss = progress.interval_loss_sum / progress.interval_loss_count if progress.interval_loss_count else None
        timed = self.meter.timed  # empty timings when nothing was trained since the resume
        row = {
            "epoch": progress.epoch + (1 if progress.batches_done else 0),  # 1-based: the epoch the step is in
            "step": progress.global_step,
            "train_loss": train_loss,
            **metrics,
            **self.meter.timing_columns(interval),
            "world_size": self.accelerator.num_processes,
        }
        progress.train_time_sec += interval if timed else 0.0
        if self.run.is_main:
            try:
                MetricsFile(self.run.output_dir).append(row)
            except OSError as error:  # a full disk: one line naming it; the checkpoints stay as they are
                raise checkpoint.disk_error(error, self.run.output_dir / METRICS_FILE) from None
            tqdm.write(" ".join(f"{k}={_short(v)}" for k, v in row.items() if k in metrics or k in LEADING_COLUMNS))
        self.accelerator.log(dict(metrics) | {"train/mean_loss": train_loss or 0.0}, step=progress.global_step)
        if scheduled:
            progress.interval_loss_sum, progress.interval_loss_count = 0.0, 0
        self.meter.new_interval()
        return metrics

    def _update_best(self, metrics: dict) -> bool:
        if self.main_metric not in metrics:  # the recipe's own mistake: one line naming what there is, every rank
            raise UsageError(
                f"TrainingLoop(main_metric={self.main_metric!r}) is not among the metrics evaluate() returned "
                f"({', '.join(sorted(metrics)) or 'none'}); give one of them"
            )
        value = metrics[self.main_metric]
        best = self.progress.best_value
        better = best is None or (value > best if self.higher_is_better else value < best)
        if better:
            self.progress.best_value = value
            self.progress.best_step = self.progress.global_step
            self.progress.best_metrics = dict(metrics)
        return better

    def save(self) -> None:
        """A complete checkpoint of the current position (collective), once per step."""
        if self.keeper.saved(self.progress.global_step):
            return
        now = time.perf_counter()
        self.progress.wall_time_sec += now - self._wall_mark
        self._wall_mark = now
        self.keeper.save(self.progress)

    # ---- the end --------------------------------------------------------------------------------------------
    def load_best(self) -> Path | None:
        """Load the best-validation weights (if they are not the current ones); returns their checkpoint."""
        progress = self.progress
        self.meter.close_bar()
        if progress.best_step is None:
            return None
        best_checkpoint = self.keeper.step_dir(progress.best_step)
        if progress.best_step != progress.global_step:
            self.keeper.load_weights(best_checkpoint)
        return best_checkpoint

    def test(self, run_test) -> dict:
        """Run `run_test()` (model in eval mode, no_grad) and keep its metrics for summary.json."""
        self.model.eval()
        with torch.no_grad():
            metrics = run_test()
        bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            self._diverged(f"the test metric {bad[0]} is {metrics[bad[0]]} (best step {self.progress.best_step})")
        self._test_metrics = dict(metrics)
        return metrics

    def finish_at_best(self, run_test, extra: dict | None = None) -> dict:
        """The end of a recipe that tests its best-validation weights: load them, run `run_test()` (see test), write
        the summary and end the run (finish), and print the test metrics as a table. Returns summary.json's dict."""
        self.load_best()
        metrics = self.test(run_test)
        summary = self.finish(extra=extra)
        self.run.print(format_table(f"test metrics at the best validation step {summary['best_step']}", metrics))
        return summary

    def finish(self, extra: dict | None = None) -> dict:
        """Write summary.json and curves.png, log the test metrics, end the trackers and the process group."""
        progress, run = self.progress, self.run
        self.meter.close_bar()
        best_checkpoint = None
        if progress.best_step is not None:
            best_checkpoint = self.keeper.step_dir(progress.best_step)
        summary = {
            "recipe": run.recipe,
            "run_name": run.run_name,
            "global_step": progress.global_step,
            "epochs_completed": progress.epoch,
            "world_size": self.accelerator.num_processes,
            "stop_reason": progress.stop_reason,
            "main_metric": self.main_metric,  # what "best" means, for toolkit compare
            "higher_is_better": self.higher_is_better,
            "final_metrics": progress.last_metrics,
            "best_step": progress.best_step,
            "best_metrics": progress.best_metrics,
            "best_checkpoint": str(best_checkpoint) if best_checkpoint else None,
            "test_metrics_at_best": self._test_metrics,
            "train_time_sec": round(progress.train_time_sec, 2),
            # Every life's time up to its last checkpoint, plus this life's since then (a killed life's time after
            # its last checkpoint is lost with its work: it is in no life's kept work).
            "wall_time_sec": round(progress.wall_time_sec + time.perf_counter() - self._wall_mark, 2),
            "wall_time_this_life_sec": round(time.perf_counter() - self._run_started, 2),
            **(extra or {}),
        }
        if run.is_main:
            try:
                write_json(run.output_dir / SUMMARY_FILE, summary)
                plot_curves(run.output_dir, self.main_metric)
            except extras.MissingExtra as missing:  # the plot is a convenience: the run's results stand
                run.print(f"curves.png not drawn: {missing}")
            except OSError as error:
                raise checkpoint.disk_error(error, run.output_dir) from None
        if self._test_metrics:
            self.accelerator.log({f"best/{k}": v for k, v in self._test_metrics.items()}, step=progress.global_step)
        # All ranks leave together (rank 0 may still be writing the plot), then the trackers and the group end.
        shutdown.end_process_group(self.accelerator)
        return summary

    @property
    def total_steps(self) -> int:
        return total_training_steps(self.config, self.batches_per_epoch or len(self.train_loader))


def _short(value):
    return f"{value:.4f}" if isinstance(value, float) else value
