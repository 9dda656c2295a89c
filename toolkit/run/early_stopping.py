"""Early stopping on a validation metric, written once: pass it to the loop's state= (a resume continues its count)
and call it from the recipe's evaluate() with the metrics.

    early_stopping = EarlyStopping("val_loss", patience=20, min_delta=0.0, higher_is_better=False)
    def validate():
        metrics = ...
        early_stopping.after_evaluation(loop, metrics)
        return metrics
    loop = TrainingLoop(..., evaluate=validate, state={"early_stopping": early_stopping})
"""

from __future__ import annotations


class EarlyStopping:
    def __init__(self, metric: str, patience: int, min_delta: float = 0.0, *, higher_is_better: bool = False,
                 min_epochs: int = 0, stop: bool = True, why_not_stopping: str = "reported only"):
        """patience: evaluations without an improvement by more than min_delta before the run stops (0 = never).
        min_epochs: never stop before this many epochs. stop=False only says so, once (as the UFS teams' training
        reports its patience and trains on); why_not_stopping names the reason in that line."""
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.higher_is_better, self.min_epochs = higher_is_better, min_epochs
        self.stop, self.why_not_stopping = stop, why_not_stopping
        self.best, self.stale = float("inf"), 0  # the best is kept as a loss (negated when higher is better)

    def update(self, value: float) -> bool:
        """Record an evaluation; True when the patience has run out."""
        value = -value if self.higher_is_better else value
        if value < self.best - self.min_delta:
            self.best, self.stale = value, 0
        else:
            self.stale += 1
        return bool(self.patience) and self.stale >= self.patience

    def after_evaluation(self, loop, metrics: dict) -> None:
        """Record `metrics`; when the patience runs out, ask the loop to stop (or say so once, with stop=False)."""
        if not self.update(metrics[self.metric]):
            return
        why = f"{self.metric} has not improved by {self.min_delta} for {self.patience} evaluations"
        if not self.stop:
            if self.stale == self.patience:
                loop.run.print(f"{why} ({self.why_not_stopping})")
        elif loop.progress.epoch >= self.min_epochs:
            loop.request_stop(why)

    def state_dict(self) -> dict:
        return {"best": self.best, "stale": self.stale}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.stale = state["best"], state["stale"]
