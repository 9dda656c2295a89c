"""summary.json: what a finished run reports (its best step, its test metrics, its time), and curves.png beside it."""

from __future__ import annotations

import time
from pathlib import Path

from toolkit.loop.progress import Progress
from toolkit.process import extras
from toolkit.run import checkpoint
from toolkit.run.rundir import SUMMARY_FILE
from toolkit.run.tracking import format_table, plot_curves, write_json


def run_summary(run, progress: Progress, *, main_metric: str, higher_is_better: bool, test_metrics: dict,
                best_checkpoint: Path | None, wall_time_sec: float, wall_time_this_life_sec: float,
                extra: dict | None = None) -> dict:
    return {
        "recipe": run.recipe,
        "run_name": run.run_name,
        "global_step": progress.global_step,
        "epochs_completed": progress.epoch,
        "world_size": run.accelerator.num_processes,
        "stop_reason": progress.stop_reason,
        "main_metric": main_metric,  # what "best" means, for toolkit compare
        "higher_is_better": higher_is_better,
        "final_metrics": progress.last_metrics,
        "best_step": progress.best_step,
        "best_metrics": progress.best_metrics,
        "best_checkpoint": str(best_checkpoint) if best_checkpoint else None,
        "test_metrics_at_best": test_metrics,
        "train_time_sec": round(progress.train_time_sec, 2),
        "wall_time_sec": round(wall_time_sec, 2),
        "wall_time_this_life_sec": round(wall_time_this_life_sec, 2),
        **(extra or {}),
    }


def write_summary(run, summary: dict) -> None:
    """summary.json and curves.png, by the main process; a missing plotting extra is one line, a full disk one
    line naming it."""
    if not run.is_main:
        return
    try:
        write_json(run.output_dir / SUMMARY_FILE, summary)
        plot_curves(run.output_dir, summary["main_metric"])
    except extras.MissingExtra as missing:  # the plot is a convenience: the run's results stand
        run.print(f"curves.png not drawn: {missing}")
    except OSError as error:
        raise checkpoint.disk_error(error, run.output_dir) from None


def finish_run(run, progress: Progress, evaluations, keeper, *, extra: dict | None, wall_time_sec: float,
               wall_time_this_life_sec: float) -> dict:
    """The end of a run on every rank: summary.json and curves.png (main process), the test metrics logged, then
    the run ends (all ranks leave together: rank 0 may still be writing the plot; the trackers and the group)."""
    test_metrics = evaluations.test_metrics
    best = keeper.step_dir(progress.best_step) if progress.best_step is not None else None
    summary = run_summary(run, progress, main_metric=evaluations.main_metric,
                          higher_is_better=evaluations.higher_is_better, test_metrics=test_metrics,
                          best_checkpoint=best, wall_time_sec=wall_time_sec,
                          wall_time_this_life_sec=wall_time_this_life_sec, extra=extra)
    write_summary(run, summary)
    if test_metrics:
        run.accelerator.log({f"best/{k}": v for k, v in test_metrics.items()}, step=progress.global_step)
    run.end()
    return summary


class RunEnd:
    """The end of a training run, a part of TrainingLoop (toolkit.loop.training): the best weights, the test,
    summary.json
    and the run's end. It reads the loop's meter, keeper, progress, evaluations and wall-time marks."""

    def load_best(self) -> Path | None:
        """Load the best-validation weights (if they are not the current ones); returns their checkpoint."""
        self.meter.close_bar()
        return self.keeper.load_best(self.progress.best_step, self.progress.global_step)

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
        self.meter.close_bar()
        now = time.perf_counter()  # wall time: every life's up to its last checkpoint, and this life's since then
        return finish_run(self.run, self.progress, self.evaluations, self.keeper, extra=extra,
                          wall_time_sec=self.progress.wall_time_sec + now - self._wall_mark,
                          wall_time_this_life_sec=now - self._run_started)
