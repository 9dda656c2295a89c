"""W&B: offline by itself without credentials, the run files hold the config, a resume continues the same run."""

import json

import pytest
from conftest import TINY, read_json, run_recipe
from wandb_records import run_config

pytestmark = pytest.mark.slow


def test_wandb_offline_run_holds_config_and_resume_keeps_its_id(tmp_path, movielens_cache):
    out = tmp_path / "run"
    home = tmp_path / "home"  # no ~/.netrc, no API key: must go offline by itself
    home.mkdir()
    args = [a if a != "none" else "wandb" for a in TINY]
    env = {"HOME": str(home)}
    first = run_recipe([*args, "--max-steps", "2", "--output-dir", str(out)], env=env)
    assert "wandb sync" in first.stdout  # the one-line hint how to upload later
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = read_json(out / "config.json")["run_id"]
    recorded_id, config = run_config(runs[0] / f"run-{run_id}.wandb")
    assert recorded_id == run_id
    assert json.loads(config["batch_size"]) == 64 and json.loads(config["variant"]) == "sasrec"
    assert json.loads(config["world_size"]) == 1 and json.loads(config["max_steps"]) == 2

    run_recipe([*args, "--max-steps", "4", "--output-dir", str(out), "--resume-from", "auto"], env=env)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").exists() for r in runs)
    assert run_config(runs[1] / f"run-{run_id}.wandb")[0] == run_id  # the resumed life continues the same run
