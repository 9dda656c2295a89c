"""The loop's small parts, in process: the divergence guards, early stopping, the range checks a recipe's check()
uses, the optimizer choice, and how a run's end is chosen for each way main() can end (toolkit.process.shutdown)."""

import math
from types import SimpleNamespace

import pytest
import torch

from toolkit.errors import RunFailed, TrainingStopped, UsageError
from toolkit.loop.guards import loss_problem, nonfinite_metric, stopped_without_saving
from toolkit.loop.progress import Progress, total_training_steps
from toolkit.process.shutdown import breaks_group
from toolkit.run.config import require_finite, require_range
from toolkit.run.early_stopping import EarlyStopping
from toolkit.run.optim import make_optimizer, model_line


def test_loss_problem_names_nonfinite_and_exploded_losses():
    assert loss_problem(1.0, 1.0, 0.0, 3) is None
    assert loss_problem(float("nan"), 1.0, 0.0, 3) == "the training loss is nan at step 3"
    assert loss_problem(float("inf"), None, 10.0, 1) == "the training loss is inf at step 1"
    assert loss_problem(9.9, 1.0, 10.0, 5) is None  # within the ratio
    exploded = loss_problem(-10.5, 1.0, 10.0, 5)  # |loss| counts: a loss may be negative
    assert exploded.startswith("the training loss exploded to -10.5 at step 5, more than --max-loss-ratio 10")
    assert loss_problem(1e9, 1.0, 0.0, 5) is None  # ratio 0: off


def test_nonfinite_metric_and_the_stop_line(tmp_path):
    assert nonfinite_metric({"a": 1.0, "n": 3}) is None
    assert nonfinite_metric({"a": 1.0, "b": float("nan"), "c": float("inf")}) == "b"
    stop = stopped_without_saving("the training loss is nan at step 4", tmp_path, best_step=2)
    assert isinstance(stop, TrainingStopped) and isinstance(stop, RunFailed)
    assert "the last good checkpoint (none) and the best one (step_2) are kept" in str(stop)


def test_early_stopping_counts_evaluations_and_survives_a_resume():
    stopping = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    assert [stopping.update(v) for v in [1.0, 0.95, 0.8, 0.79, 0.75]] == [False, False, False, False, True]
    resumed = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    resumed.load_state_dict(stopping.state_dict())
    assert resumed.stale == 2 and resumed.best == 0.8
    higher = EarlyStopping("acc", patience=1, higher_is_better=True)
    assert [higher.update(v) for v in [0.5, 0.6, 0.6]] == [False, False, True]


def test_early_stopping_asks_the_loop_once_epochs_allow_or_reports_once():
    said, stops = [], []
    loop = SimpleNamespace(progress=Progress(epoch=1), run=SimpleNamespace(print=said.append),
                           request_stop=stops.append)
    stopping = EarlyStopping("val_loss", patience=1, min_epochs=2)
    for value in [1.0, 2.0]:
        stopping.after_evaluation(loop, {"val_loss": value})
    assert stops == []  # before --min-epochs
    loop.progress.epoch = 2
    stopping.after_evaluation(loop, {"val_loss": 3.0})
    assert stops == ["val_loss has not improved by 0.0 for 1 evaluations"]
    reporting = EarlyStopping("val_loss", patience=1, stop=False, why_not_stopping="reported only: --no-stop-early")
    for value in [1.0, 2.0, 3.0]:
        reporting.after_evaluation(loop, {"val_loss": value})
    assert said == ["val_loss has not improved by 0.0 for 1 evaluations (reported only: --no-stop-early)"]


@pytest.mark.parametrize(("interval", "inside", "outside"), [
    ("[0, 1)", [0.0, 0.5], [1.0, -0.1, math.nan]),
    ("(0, 1]", [1.0, 1e-9], [0.0, 1.5, math.nan]),
    ("[0, 90]", [0.0, 90.0], [90.5, -1.0]),
])
def test_require_range_reads_the_interval_as_written(interval, inside, outside):
    for value in inside:
        require_range(SimpleNamespace(drop_rate=value), interval, "drop_rate")
    for value in outside:
        with pytest.raises(UsageError, match=rf"^--drop-rate {value} is invalid; it must be in \{interval[0]}"):
            require_range(SimpleNamespace(drop_rate=value), interval, "drop_rate")


def test_require_finite():
    require_finite(SimpleNamespace(weight_decay=0.0), "weight_decay")
    with pytest.raises(UsageError, match=r"^--weight-decay inf is invalid; it must be a finite number >= 0$"):
        require_finite(SimpleNamespace(weight_decay=math.inf), "weight_decay")
    with pytest.raises(UsageError, match=r"^--expansion 0.0 is invalid; it must be a finite number > 0$"):
        require_finite(SimpleNamespace(expansion=0.0), "expansion", inclusive=False)


def test_make_optimizer_takes_the_settings_and_refuses_an_unknown_name():
    model = torch.nn.Linear(3, 2)
    adam = make_optimizer("adam", model.parameters(), lr=0.01, betas=(0.9, 0.98), eps=1e-3, weight_decay=0.1)
    assert type(adam) is torch.optim.Adam
    group = adam.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.9, 0.98), 1e-3, 0.1)
    assert len(group["params"]) == 2
    sgd = make_optimizer("sgd", model.parameters(), lr=0.5, weight_decay=0.2)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["weight_decay"] == 0.2
    import toolkit.models.hrm  # noqa: F401  registers HRM's adam-atan2 (the core knows no family)

    atan2 = make_optimizer("adam-atan2", model.parameters(), lr=0.01, betas=(0.9, 0.95))
    assert type(atan2).__name__ == "AdamATan2" and atan2.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(UsageError, match="^--optimizer adamx is not known; give one of adam, adamw"):
        make_optimizer("adamx", model.parameters(), lr=0.01)
    assert model_line("Linear 3 -> 2", model) == "model: Linear 3 -> 2, 8 parameters"


def test_total_training_steps_counts_windows_and_caps_at_max_steps():
    config = SimpleNamespace(grad_accum=2, epochs=3, max_steps=None)
    assert total_training_steps(config, 5) == 9  # ceil(5 / 2) x 3
    assert total_training_steps(config, lambda epoch: 4 + epoch) == 2 + 3 + 3
    config.max_steps = 4
    assert total_training_steps(config, 5) == 4
    assert Progress.from_saved({"global_step": 7, "added_by_a_newer_toolkit": 1}).global_step == 7


@pytest.mark.parametrize(("error", "broken"), [
    (UsageError("bad flag"), False),  # every rank checks the same input
    (TrainingStopped("nan"), False),  # the ranks agreed on it
    (SystemExit(0), False),  # pre-empted: every rank leaves
    (SystemExit(2), False),
    (SystemExit(1), True),
    (RuntimeError("a bug on this rank alone"), True),
    (KeyboardInterrupt(), True),
])
def test_which_ends_leave_the_process_group_alone(error, broken):
    assert breaks_group(error) is broken


def test_step_losses_read_many_steps_in_one_copy_as_the_same_floats():
    from toolkit.loop.losses import StepLosses

    losses = StepLosses(read_every=3)
    values = [[0.1, 0.2], [0.3], [float("nan")]]
    for step, micro in enumerate(values, start=1):
        for value in micro:
            losses.record(torch.tensor(value, dtype=torch.float32))
        losses.close_step(step, epoch=0)
        assert losses.read_due(step) == (step == 3)
    rider = torch.tensor([1.5, 2.5], dtype=torch.float64)
    reads, carried = losses.read(rider)
    assert [r.step for r in reads] == [1, 2, 3] and losses.unread == 0
    for read, micro in zip(reads, values, strict=True):  # exactly what float() of each float32 loss gives
        assert read.micro_batches == [float(torch.tensor(v, dtype=torch.float32)) for v in micro] or math.isnan(
            read.mean)
    assert carried == [1.5, 2.5]
    assert losses.read() == ([], [])


def test_a_gpu_busy_under_30_percent_of_its_first_minute_is_said_once():
    from toolkit.loop.meter import StepMeter

    def meter_at(busy: float):
        said, now = [], [0.0]
        meter = StepMeter(torch.device("cuda"), show_bar=False, say=said.append, utilisation=lambda: busy,
                          clock=lambda: now[0])
        for _ in range(200):  # a step every 0.5 s: 100 s of training, a reading a second
            now[0] += 0.5
            meter.stepped(epoch=0, step_loss=1.0)
        return said, meter

    said, meter = meter_at(12.0)
    assert len(said) == 1 and said[0].startswith("the GPU was busy 12% of the first minute: it waits for the host")
    assert all(hint in said[0] for hint in ("--batch-size", "--cuda-graphs", "--runs-per-device"))
    assert len(meter.timer.gpu_util) == 100  # one reading a second
    assert meter_at(55.0)[0] == []  # busy enough: nothing said
    cpu = StepMeter(torch.device("cpu"), show_bar=False, say=said.append, utilisation=lambda: 0.0)
    cpu.stepped(epoch=0, step_loss=1.0)
    assert cpu.timer.gpu_util == []
