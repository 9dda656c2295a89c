"""tests/fault_campaign.py (`make faults`, not run by the suite): its flags, and a seed that gives the same trials."""

from __future__ import annotations

import fault_campaign as faults
import pytest


def test_a_seed_gives_the_same_trials_and_the_quick_campaign_keeps_the_pinned_moments():
    full = faults.trials_of(faults.parse(["--seed", "11"]))
    assert full == faults.trials_of(faults.parse(["--seed", "11"]))
    assert {k: len(v) for k, v in full.items()} == faults.DEFAULT_TRIALS
    quick = faults.trials_of(faults.parse(["--seed", "11", "--quick"]))
    assert [t.moment for t in quick["kill"]][:2] == [("save", 4), ("step", 5)]  # from step_3, before the first row
    assert quick["signal"][0].describe() == "toy toolkit launch, SIGTERM to launcher after step 1"
    only = faults.trials_of(faults.parse(["--seed", "11", "--only", "signal", "--trials", "20"]))
    assert list(only) == ["signal"] and len(only["signal"]) == 20
    # --only runs a campaign's trials as the whole campaign would: the others' draws are still made
    assert faults.trials_of(faults.parse(["--seed", "11", "--only", "signal"]))["signal"] == full["signal"]
    for trial in full["kill"] + full["signal"]:
        kind, value = trial.moment
        steps = faults.RECIPES[trial.recipe].steps
        assert (
            (kind == "step" and 1 <= value <= steps - 2)
            or (kind == "save" and 1 <= value < steps)
            or (kind == "time" and 0 < value <= 1)
        )
    assert all(t.moment[0] == "kb" and 0 <= t.moment[1] < 244 for t in full["disk"])


def test_flags_are_checked_and_the_plan_prints_the_seed(capsys):
    with pytest.raises(SystemExit):
        faults.parse(["--trials", "0"])
    with pytest.raises(SystemExit):
        faults.parse(["--only", "flood"])
    assert faults.main(["--seed", "5", "--quick", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "seed 5" in out and "--seed 5 --quick" in out and "kill  1: toy 1 process, SIGKILL to process" in out
