"""A search's trial seen from inside its run: each evaluation reports the searched metric to the study, and the
study's pruner may end the run there.

`python -m toolkit sweep --search ...` starts each trial as an ordinary run with TOOLKIT_TRIAL set (a JSON object:
the journal file, the study, the trial number, the metric, the direction, the pruner). The training loop then asks
`TrialReporter.report(metrics, step)` after every evaluation; a pruned trial ends as a run stopped on request does:
every rank agrees on the stop at that step, the step is checkpointed, summary.json holds the reason (`pruned at
step N ...`) and the process exits 0. Only the main process talks to Optuna; optuna is imported when a trial first
reports, so a run outside a search (and `import toolkit`) never loads it.
"""

from __future__ import annotations

import json
import os
import warnings

from toolkit.errors import UsageError

ENV = "TOOLKIT_TRIAL"
# {"metric": NAME, "direction": "max"|"min"}: the recipe checks them once its loop is built (the recipe's main
# metric without evaluating, any other by one evaluation of the untrained model), then exits 0 or 2 with one line.
# `sweep --search` runs this once before a study's first trial, so a wrong --metric costs seconds, not a trial.
PROBE_ENV = "TOOLKIT_METRIC_PROBE"
PRUNED = "pruned at step "  # how summary.json's stop_reason of a pruned trial begins


def open_storage(journal: str):
    """Optuna's journal storage on a file: JournalFileBackend (optuna >= 4), JournalFileStorage before it."""
    import optuna.storages

    try:
        from optuna.storages.journal import JournalFileBackend as backend
    except ImportError:  # optuna 3.x
        backend = optuna.storages.JournalFileStorage
    return optuna.storages.JournalStorage(backend(str(journal)))


def make_pruner(name: str, startup_trials: int):
    """The study's pruner: none, median (a trial below the median of the finished trials at the same step, once
    startup_trials have finished) or hyperband (Optuna's defaults)."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def pruned_step(summary: dict | None) -> int | None:
    """The step a trial's run was pruned at (its summary.json), or None when it was not pruned."""
    reason = (summary or {}).get("stop_reason") or ""
    return int(summary["global_step"]) if reason.startswith(PRUNED) else None


def check_metric(metric: str, direction: str, reported, main_metric: str, higher_is_better: bool) -> None:
    """A searched metric the recipe does not report, or the wrong direction for its main metric: one line."""
    if metric not in reported:
        raise UsageError(f"--metric {metric} is not among the metrics the recipe reports "
                         f"({', '.join(sorted(reported))}); give one of them")
    if metric == main_metric and (direction == "max") != higher_is_better:
        better = "higher" if higher_is_better else "lower"
        raise UsageError(f"--direction {direction}, but the recipe's {metric} is better {better}; give "
                         f"--direction {'max' if higher_is_better else 'min'}")


def probe_metric(main_metric: str, higher_is_better: bool, evaluate) -> None:
    """Under TOOLKIT_METRIC_PROBE: check the searched metric and direction against the recipe and exit (0 when
    right); evaluate() (the untrained model's validation metrics) is called only for a metric other than the main
    one. Does nothing otherwise."""
    text = os.environ.get(PROBE_ENV)
    if not text:
        return
    spec = json.loads(text)
    reported = [main_metric] if spec["metric"] == main_metric else list(evaluate())
    check_metric(spec["metric"], spec["direction"], reported, main_metric, higher_is_better)
    raise SystemExit(0)


class TrialReporter:
    def __init__(self, spec: dict, is_main: bool, main_metric: str, higher_is_better: bool):
        self.spec, self.is_main = spec, is_main
        self.main_metric, self.higher_is_better = main_metric, higher_is_better
        self._trial = None

    @classmethod
    def from_environment(cls, is_main: bool, main_metric: str, higher_is_better: bool) -> TrialReporter | None:
        """The reporter of the trial this process runs (TOOLKIT_TRIAL), or None outside a search."""
        text = os.environ.get(ENV)
        return cls(json.loads(text), is_main, main_metric, higher_is_better) if text else None

    def report(self, metrics: dict, step: int) -> str | None:
        """Report the metric at this step (main process); the reason to stop when the pruner prunes, else None.
        Every rank checks the metric's name (every rank has the same metrics), so a wrong one stops them all."""
        metric = self.spec["metric"]
        check_metric(metric, self.spec["direction"], metrics, self.main_metric, self.higher_is_better)
        if not self.is_main:
            return None
        trial, value = self._study_trial(), float(metrics[metric])
        with warnings.catch_warnings():  # a resumed trial reports its last evaluated step again: ignored
            warnings.simplefilter("ignore")
            trial.report(value, step)
        if self.spec["pruner"] != "none" and trial.should_prune():
            return f"{PRUNED}{step} by the search's {self.spec['pruner']} pruner ({metric} {value:.4g})"
        return None

    def _study_trial(self):
        if self._trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            spec = self.spec
            study = optuna.load_study(study_name=spec["study"], storage=open_storage(spec["journal"]),
                                      pruner=make_pruner(spec["pruner"], spec["prune_after_trials"]))
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, spec["trial"])
            self._trial = optuna.trial.Trial(study, trial_id)
        return self._trial
