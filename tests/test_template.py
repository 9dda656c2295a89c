"""recipes/template.py, the recipe a new family starts from: it runs on 1 and 2 processes as one, resumes byte for
byte, verifies, and stays short enough to read at once."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, final_weights, logged_losses, ranks_seen, run_recipe
from toolkit.tools.verify import verify_run

ARGS = ["--samples", "640", "--max-steps", "10", "--eval-every-steps", "5", "--log-every", "1", "--threads", "1"]


def test_the_template_is_short():
    lines = (ROOT / "recipes" / "template.py").read_text().splitlines()
    assert len(lines) < 115  # with its two presets (16 of them its imports, one name a line)


@pytest.mark.slow
def test_one_and_two_processes_train_as_one_and_a_resume_is_byte_identical(tmp_path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    first = run_recipe([*ARGS, "--output-dir", str(one)], recipe="template")
    second = run_recipe([*ARGS, "--output-dir", str(two)], recipe="template", config="cpu_2proc.yaml")
    assert ranks_seen(first.stdout + first.stderr) == {(0, 1)}
    assert ranks_seen(second.stdout + second.stderr) == {(0, 2), (1, 2)}
    for run_dir, world in ((one, 1), (two, 2)):
        assert verify_run(run_dir, expect_world_size=world) == []
    l1, l2 = logged_losses(one), logged_losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, 11))
    assert max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1) < 1e-5  # dropout on: keyed masks, global batch
    w1, w2 = final_weights(one, 10), final_weights(two, 10)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    assert l1[10] < l1[1]  # it learns

    run_recipe([*ARGS, "--max-steps", "5", "--output-dir", str(resumed)], recipe="template")
    again = run_recipe([*ARGS, "--output-dir", str(resumed), "--resume-from", "auto"], recipe="template")
    assert "resumed at epoch" in again.stdout + again.stderr
    same = (one / "checkpoints" / "step_10" / "model.safetensors").read_bytes()
    assert (resumed / "checkpoints" / "step_10" / "model.safetensors").read_bytes() == same
    assert verify_run(resumed, expect_world_size=1) == []
