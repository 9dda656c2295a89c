"""Evaluation from the loop's side: the recipe's evaluate() or test function run in eval mode under no_grad,
non-finite metrics refused, the best step kept, the metrics.csv row written and logged."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from toolkit.errors import UsageError
from toolkit.loop.guards import nonfinite_metric, stopped_without_saving
from toolkit.loop.progress import Progress
from toolkit.run import checkpoint
from toolkit.run.rundir import METRICS_FILE
from toolkit.run.tracking import LEADING_COLUMNS, MetricsFile


class Evaluations:
    def __init__(self, run, model, evaluate, main_metric: str, higher_is_better: bool, meter):
        """evaluate(): validation metrics {name: number}, the same values on every rank (gather_for_metrics)."""
        self.run, self.model, self.evaluate_fn, self.meter = run, model, evaluate, meter
        self.main_metric, self.higher_is_better = main_metric, higher_is_better
        self.test_metrics: dict = {}
        # () -> {column: value}: a recipe's own columns in every metrics.csv row, after the metrics; not logged to
        # the tracker at the row's step (HRM's latest full test, logged at its own step by between_steps)
        self.row_columns = None

    def measure(self, function, then_train: bool = True) -> dict:
        """function()'s metrics, with the model in eval mode and no gradients (and back in train mode after, unless
        then_train=False: the end of a run computes its artifacts in eval mode)."""
        self.model.eval()
        with torch.no_grad():
            metrics = function()
        if then_train:
            self.model.train()
        return metrics

    def refuse_nonfinite(self, metrics: dict, kind: str, where: str, progress: Progress) -> None:
        """A non-finite metric stops the run in one line, `the <kind> metric <name> is nan <where>`."""
        bad = nonfinite_metric(metrics)
        if bad is not None:
            self.meter.close_bar()
            raise stopped_without_saving(f"the {kind} metric {bad} is {metrics[bad]} {where}", self.run.output_dir,
                                         progress.best_step)

    def validate(self, progress: Progress, scheduled: bool = True) -> dict:
        """Evaluate, refuse non-finite metrics, update the best, write the metrics.csv row, log.

        The row's train_loss is the mean since the previous scheduled evaluation; an unscheduled one (the end of a
        run stopped by --max-steps or a request) does not restart that mean, so a run resumed past it writes the
        rows an uninterrupted run writes."""
        # The row's interval is the training since the last row (its steps, and the checkpoint saved after that
        # row): read before evaluating, so epoch_time_sec and throughput leave the evaluation out.
        interval = self.meter.interval_seconds()
        metrics = self.measure(self.evaluate_fn)
        self.refuse_nonfinite(metrics, "validation", f"at step {progress.global_step}", progress)
        self._update_best(metrics, progress)
        progress.last_metrics = metrics
        progress.last_eval_step = progress.global_step
        train_loss = progress.interval_loss_sum / progress.interval_loss_count if progress.interval_loss_count else None
        timed = self.meter.timed  # empty timings when nothing was trained since the resume
        row = {
            "epoch": progress.epoch + (1 if progress.batches_done else 0),  # 1-based: the epoch the step is in
            "step": progress.global_step,
            "train_loss": train_loss,
            **metrics,
            **(self.row_columns() if self.row_columns is not None else {}),
            **self.meter.timing_columns(interval),
            "world_size": self.run.accelerator.num_processes,
        }
        progress.train_time_sec += interval if timed else 0.0
        if self.run.is_main:
            try:
                MetricsFile(self.run.output_dir).append(row)
            except OSError as error:  # a full disk: one line naming it; the checkpoints stay as they are
                raise checkpoint.disk_error(error, self.run.output_dir / METRICS_FILE) from None
            tqdm.write(" ".join(f"{k}={_short(v)}" for k, v in row.items() if k in metrics or k in LEADING_COLUMNS))
        self.run.accelerator.log(dict(metrics) | {"train/mean_loss": train_loss or 0.0}, step=progress.global_step)
        if scheduled:
            progress.interval_loss_sum, progress.interval_loss_count = 0.0, 0
        self.meter.new_interval()
        return metrics

    def between_steps(self, function, step: int, progress: Progress) -> dict:
        """A recipe's own evaluation at a cadence of its own, made in a training step's body after its optimizer step
        (HRM's whole test split every --eval-full-test-every steps): function()'s metrics (eval mode, no_grad, then
        train mode again), a non-finite one refused, shown and logged to the tracker at `step`. Its time is left out
        of the training's: of the interval the next metrics row times (epoch time, throughput) and of the step's
        compute time (measured around the step's body)."""
        began = time.perf_counter()
        metrics = self.measure(function)
        self.refuse_nonfinite(metrics, "evaluation", f"at step {step}", progress)
        if self.run.is_main:
            tqdm.write(" ".join([f"step={step}", *(f"{k}={_short(v)}" for k, v in metrics.items())]))
        self.run.accelerator.log(dict(metrics), step=step)
        spent = time.perf_counter() - began
        self.meter.timer.started += spent
        self.meter.timer.compute_sec -= spent
        return metrics

    def test(self, run_test, progress: Progress) -> dict:
        """run_test()'s metrics (eval mode, no_grad), kept for summary.json."""
        metrics = self.measure(run_test, then_train=False)
        self.refuse_nonfinite(metrics, "test", f"(best step {progress.best_step})", progress)
        self.test_metrics = dict(metrics)
        return metrics

    def _update_best(self, metrics: dict, progress: Progress) -> None:
        if self.main_metric not in metrics:  # the recipe's own mistake: one line naming what there is, every rank
            raise UsageError(
                f"TrainingLoop(main_metric={self.main_metric!r}) is not among the metrics evaluate() returned "
                f"({', '.join(sorted(metrics)) or 'none'}); give one of them"
            )
        value, best = metrics[self.main_metric], progress.best_value
        if best is None or (value > best if self.higher_is_better else value < best):
            progress.best_value, progress.best_step = value, progress.global_step
            progress.best_metrics = dict(metrics)


def _short(value):
    return f"{value:.4f}" if isinstance(value, float) else value
