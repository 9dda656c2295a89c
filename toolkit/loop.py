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

(or loop.load_best(); loop.test(run_test); exports, Jacobians etc. with grad; loop.finish()). This module is the
iteration and the order of things; each part lives in its own module: toolkit.progress (the counters a checkpoint
keeps), toolkit.cadence (when to evaluate and save), toolkit.agreement (what the ranks decide together),
toolkit.guards (divergence), toolkit.evaluation (evaluate, best, metrics rows), toolkit.meter (timing, the progress
bar), toolkit.keeper (save, prune, best, load), toolkit.summary (summary.json).

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

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from toolkit import compilation, preemption, randomness, shutdown
from toolkit.agreement import agree
from toolkit.cadence import epoch_end_save_due, evaluation_due, mid_epoch_save_due
from toolkit.distributed import mean_over_processes
from toolkit.errors import TrainingStopped, UsageError
from toolkit.evaluation import Evaluations
from toolkit.guards import loss_problem, stopped_without_saving
from toolkit.keeper import CheckpointKeeper
from toolkit.meter import StepMeter
from toolkit.progress import Progress, total_training_steps
from toolkit.randomness import reseed_global_rng, step_seed
from toolkit.run import Run
from toolkit.summary import run_summary, write_summary
from toolkit.tracking import format_table

__all__ = ["AFTER_STEP_HOOKS", "Progress", "TrainingLoop", "TrainingStopped", "rest_of_epoch", "require_whole_epoch"]


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
        self.run, self.config, self.accelerator = run, run.config, run.accelerator
        self.model, self.train_loader, self.batches_per_epoch = model, train_loader, batches_per_epoch
        self.main_metric, self.higher_is_better = main_metric, higher_is_better
        self.rank_state = dict(rank_state or {})
        self.progress = Progress(run_id=run.run_id)
        self.stopped = False  # --max-steps reached or a stop requested: the epoch loop ends
        self._stop_request: str | None = None
        self._save_due = False  # an epoch end asked for a checkpoint (written after the epoch's body)
        self._pending_loss: list[torch.Tensor] = []
        self.keeper = CheckpointKeeper(run, model, dict(state or {}), self.rank_state)
        self.meter = StepMeter(self.accelerator.device, show_bar=run.is_main)
        self.evaluations = Evaluations(run, model, evaluate, main_metric, higher_is_better, self.meter)
        self._run_started = self._wall_mark = time.perf_counter()  # this life; wall time not yet in progress
        self._compile_report = compilation.first_step_reporter(run)  # --compile: its cost, once a life
        plain_dropout = randomness.rank_dependent_dropout_line(model)
        if plain_dropout:
            run.print(plain_dropout)

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
        if saved is not None:
            self.progress = where = Progress.from_saved(saved)
            run.print(f"resumed at epoch {where.epoch}, batch {where.batches_done}, step {where.global_step}")

    # ---- iteration ----------------------------------------------------------------------------------------
    def epochs(self):
        """Yield epoch numbers until --epochs, --max-steps or a stop request; then evaluate and save the end."""
        cfg, progress = self.config, self.progress
        if not self.run.begun:
            raise RuntimeError("call loop.start() before iterating loop.epochs()")
        self.meter.open_bar(self.total_steps, progress.global_step, self.run.recipe)
        past_max_steps = cfg.max_steps is not None and progress.global_step >= cfg.max_steps
        self.stopped = bool(progress.stop_reason) or past_max_steps  # resumed after a stop or at --max-steps
        while progress.epoch < cfg.epochs and not self.stopped:
            yield progress.epoch
            if agree(self.accelerator, stop=self._stop_request is not None).stop and not self.stopped:
                self._take_stop_request()
            if self._save_due:
                self.save()
                self._save_due = False
        if progress.last_eval_step != progress.global_step:
            self.evaluations.validate(progress, scheduled=self._evaluation_due())
        self.save()
        randomness.end_micro_batches()

    def batches(self):
        """Yield this epoch's micro-batches, continuing mid-epoch after a resume; stops at --max-steps."""
        accelerator, progress, cfg, loader = self.accelerator, self.progress, self.config, self.train_loader
        loader.set_epoch(progress.epoch)  # the sampler's order is a function of (data seed, epoch)
        iterator = iter(rest_of_epoch(accelerator, loader, progress.batches_done))
        accelerator.step = 0  # Accelerate's accumulation counter: windows restart with the epoch, also on resume
        self.meter.begin_epoch()
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
        """The step's loss read and guarded, the ranks' agreement, the bar and log; then pre-emption, a stop, and
        the mid-epoch evaluation and checkpoint when due (an epoch end or the loop's end does those itself)."""
        cfg, progress = self.config, self.progress
        # Python floats: one device-to-host copy per micro-batch and no small tensors (a few us each, every step)
        losses = [float(loss) for loss in self._pending_loss]
        self._pending_loss.clear()
        step_loss = sum(losses) / len(losses) if losses else float("nan")
        if self._compile_report is not None:  # --compile: the first step's compute, said once (toolkit/compilation.py)
            self._compile_report = self._compile_report(self.meter.timer.compute_sec)
        if progress.first_loss is None and math.isfinite(step_loss):
            progress.first_loss = step_loss
        problem = loss_problem(step_loss, progress.first_loss, cfg.max_loss_ratio, progress.global_step)
        agreed = agree(self.accelerator, preempted=preemption._requested, diverged=problem is not None,
                       stop=self._stop_request is not None)
        if agreed.diverged:
            self._stop_without_saving(problem or f"the training loss is {step_loss} at step {progress.global_step}")
        progress.interval_loss_sum += sum(losses)
        progress.interval_loss_count += len(losses)
        self.meter.stepped(progress.epoch, step_loss)
        if progress.global_step % cfg.log_every == 0:
            self.accelerator.log({"train/loss": step_loss, "train/epoch": progress.epoch}, step=progress.global_step)
        if agreed.preempted:
            self._checkpoint_requeue_and_exit()
        if agreed.stop:
            self._take_stop_request()
        if cfg.max_steps is not None and progress.global_step >= cfg.max_steps:
            self.stopped = True
        if self.stopped or end_of_epoch:
            return  # the epoch end / the loop's end evaluates and saves this step
        new_best = False
        if cfg.eval_every_steps and self._evaluation_due():
            self.evaluations.validate(progress)
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

    def _stop_without_saving(self, what: str) -> None:
        self.meter.close_bar()
        raise stopped_without_saving(what, self.run.output_dir, self.progress.best_step)

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
        last = self.stopped or progress.epoch >= cfg.epochs
        due = self._evaluation_due()
        metrics = self.evaluations.validate(progress, scheduled=due) if due or last else None
        new_best = metrics is not None and progress.best_step == progress.global_step
        self._save_due = epoch_end_save_due(cfg.checkpoint_every, progress.global_step, new_best, last)
        return metrics

    def _evaluation_due(self) -> bool:
        cfg, progress = self.config, self.progress
        return evaluation_due(cfg.eval_every_steps, cfg.eval_every, progress.global_step, progress.epoch,
                              progress.batches_done)

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
        return self.evaluations.test(run_test, self.progress)

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
        now = time.perf_counter()
        test_metrics = self.evaluations.test_metrics
        summary = run_summary(
            run, progress, main_metric=self.main_metric, higher_is_better=self.higher_is_better,
            test_metrics=test_metrics,
            best_checkpoint=self.keeper.step_dir(progress.best_step) if progress.best_step is not None else None,
            # Every life's time up to its last checkpoint, plus this life's since then (a killed life's time after
            # its last checkpoint is lost with its work: it is in no life's kept work).
            wall_time_sec=progress.wall_time_sec + now - self._wall_mark,
            wall_time_this_life_sec=now - self._run_started, extra=extra)
        write_summary(run, summary)
        if test_metrics:
            self.accelerator.log({f"best/{k}": v for k, v in test_metrics.items()}, step=progress.global_step)
        run.end()  # all ranks leave together (rank 0 may still be writing the plot), then the trackers and the group
        return summary

    @property
    def total_steps(self) -> int:
        return total_training_steps(self.config, self.batches_per_epoch or len(self.train_loader))
