"""W&B: offline by itself without credentials, the run files hold the config, a resume continues the same run."""

import pytest
import yaml
from conftest import TINY, read_json, run_recipe

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
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    config = yaml.safe_load((runs[0] / "files" / "config.yaml").read_text())
    assert config["batch_size"]["value"] == 64 and config["variant"]["value"] == "sasrec"
    assert config["world_size"]["value"] == 1

    run_recipe([*args, "--max-steps", "4", "--output-dir", str(out), "--resume-from", "auto"], env=env)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").exists() for r in runs)
