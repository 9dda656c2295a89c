"""Export's registry is open: a second family joins EXPORTABLE with its two functions (rebuild the model from
config.json and the weights; describe it), and load_run finds its best checkpoint and rebuilds it. Shown with the
template recipe's run, which export does not know until it is registered."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import run_recipe
from toolkit.errors import UsageError
from toolkit.export import EXPORTABLE, Exportable, load_run
from toolkit.run.randomness import KeyedDropout


def _template_mlp(config: dict, weights: dict) -> nn.Module:
    model = nn.Sequential(nn.Linear(config["features"], config["hidden"]), nn.GELU(),
                          KeyedDropout(config["dropout"], batch_dim=0), nn.Linear(config["hidden"], 1))
    model.load_state_dict(weights)
    return model


def test_a_second_family_joins_the_registry_and_loads_at_its_best_step(tmp_path, monkeypatch):
    run_dir = tmp_path / "template"
    run_recipe(["--samples", "640", "--max-steps", "6", "--eval-every-steps", "2", "--threads", "1",
                "--output-dir", str(run_dir)], recipe="template")
    with pytest.raises(UsageError, match="is a run of 'template'; export supports ufs_emulator"):
        load_run(run_dir)

    monkeypatch.setitem(EXPORTABLE, "template", Exportable(
        build=_template_mlp, describe=lambda config, data: {"features": config["features"], "data": data}))
    model, meta = load_run(run_dir)
    import json

    best_step = json.loads((run_dir / "summary.json").read_text())["best_step"]
    assert meta["checkpoint"] == f"step_{best_step}" and meta["recipe"] == "template"
    assert meta["features"] == 8 and meta["data"]["samples"] == 640
    assert not model.training  # loaded for use: eval mode
    saved = load_file(str(run_dir / "checkpoints" / f"step_{best_step}" / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name])
    assert model(torch.zeros(3, 8)).shape == (3, 1)
