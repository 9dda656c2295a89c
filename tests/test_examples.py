"""examples/digits_cnn.py, the fifth family written on the template (a CNN on generated digits):
it learns, resumes byte for byte and verifies, with nothing of its own beyond its data, model and metric."""

from __future__ import annotations

import json

from tests.conftest import ROOT, run_recipe
from toolkit.tools.verify import verify_run

DIGITS = str(ROOT / "examples" / "digits_cnn.py")
ARGS = ["--samples", "800", "--max-steps", "10", "--eval-every-steps", "5", "--threads", "1", "--lr", "0.03"]


def test_the_digits_cnn_learns_resumes_byte_for_byte_and_verifies(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe([*ARGS, "--output-dir", str(straight)], recipe=DIGITS)
    run_recipe([*ARGS, "--max-steps", "5", "--output-dir", str(resumed)], recipe=DIGITS)
    again = run_recipe([*ARGS, "--output-dir", str(resumed), "--resume-from", "auto"], recipe=DIGITS)
    assert "resumed at epoch" in again.stdout + again.stderr
    weights = "checkpoints/step_10/model.safetensors"
    assert (resumed / weights).read_bytes() == (straight / weights).read_bytes()
    assert verify_run(resumed, expect_world_size=1) == []
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["recipe"] == "digits_cnn" and summary["test_metrics_at_best"]["test_accuracy"] > 0.3  # chance: 0.1
