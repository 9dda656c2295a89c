"""toolkit.kernels: the converter swaps in the fast paths without touching the model's state, the proof at every start
passes for the models as written and refuses an edit that a fast path does not know (naming the module, one line),
and `--kernels plain` trains the model file as it is. The HRM attention edit, at hidden 512, end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DATA_CACHE, ROOT, run_recipe
from torch import nn

from toolkit import kernels
from toolkit.errors import UsageError
from toolkit.kernels import onednn
from toolkit.models import hrm

CELLS = 81


def hrm_at(hidden: int, heads: int = 8, **sizes) -> hrm.HRM:
    torch.manual_seed(0)
    settings = dict(num_puzzle_ids=1, hidden=hidden, heads=heads, expansion=4.0, h_layers=1, l_layers=1, h_cycles=2,
                    l_cycles=2, halt_max_steps=2, exploration_prob=0.5)
    return hrm.HRM(11, CELLS, **{**settings, **sizes})


def two_puzzles() -> dict:
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(2, 11, (2, CELLS), generator=generator)
    inputs = torch.where(torch.rand(2, CELLS, generator=generator) < 0.3, 1, labels)
    return {"inputs": inputs, "labels": labels, "puzzle_ids": torch.zeros(2, dtype=torch.long), "ids": torch.arange(2)}


def hrm_example(model: hrm.HRM):
    batch = two_puzzles()
    return model(model.initial_carry(batch), batch, (0, 0, 0))


def test_convert_swaps_classes_in_place_and_keeps_the_state_and_plain_converts_nothing():
    model = hrm_at(64, heads=4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert kernels.with_kernels(model, "plain", hrm_example) == []
    assert type(model.h_level.blocks[0].attention) is hrm.Attention
    swapped = kernels.with_kernels(model, "auto", hrm_example)
    from toolkit.kernels import hrm as hrm_kernels

    attention = model.h_level.blocks[0].attention
    assert type(attention) is hrm_kernels.Attention and isinstance(attention, hrm.Attention)
    assert "h_level.blocks.0.attention" in swapped and "lm_head" in swapped and "h_level.blocks.0.norm" in swapped
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(UsageError, match="--kernels 'fast' is invalid; give one of auto, plain"):
        kernels.with_kernels(model, "fast", hrm_example)


def test_the_proof_leaves_the_model_its_gradients_and_the_random_generators_as_they_were():
    model = hrm_at(64, heads=4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    generator = torch.get_rng_state()
    kernels.with_kernels(model, "auto", hrm_example)
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    assert model.training


def scaled_attention(monkeypatch):
    """The edit a researcher makes to the model file's Attention: its output halved after the attention."""
    plain = hrm.Attention.forward

    def edited(self, x, rotary, first_only=False):
        return plain(self, x, rotary, first_only) * 0.5

    monkeypatch.setattr(hrm.Attention, "forward", edited)


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
def test_an_edit_to_hrm_attention_at_hidden_512_is_refused_under_auto_and_trained_under_plain(monkeypatch):
    """The attention edited in the model file, at hidden 512 (cpu-small's size, where the CPU kernel runs): with
    gradient and without, the plain model computes the edit (the ratio 1.0, where the kernel inside the model made it
    2.0); under auto the proof names the attention's fast path and says what to do."""
    scaled_attention(monkeypatch)
    model = hrm_at(512)
    attention, x = model.h_level.blocks[0].attention, torch.randn(2, CELLS + 1, 512)
    with torch.no_grad():
        without = attention(x, model.rotary)
    with_gradient = attention(x, model.rotary)
    torch.testing.assert_close(with_gradient.detach(), without, rtol=1e-5, atol=1e-6)
    assert kernels.with_kernels(model, "plain", hrm_example) == []
    with pytest.raises(UsageError) as refused:
        kernels.with_kernels(model, "auto", hrm_example)
    message = str(refused.value)
    assert "\n" not in message
    assert "toolkit.kernels.hrm.Attention at 'l_level.blocks.0.attention'" in message, message
    assert "toolkit.models.hrm.Attention" in message and "--kernels plain" in message
    assert "differs by 0.5" in message or "differs by 1" in message, message


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x @ self.weight.t()


class _TwiceTheGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return g @ weight, 2 * g.t() @ x  # the weight's gradient doubled: a wrong backward


class WrongBackward(Plain):
    def forward(self, x):
        return _TwiceTheGradient.apply(x, self.weight)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Plain(), nn.Linear(4, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_a_fast_path_with_a_wrong_backward_is_named_by_the_gradient_it_gets_wrong(monkeypatch):
    monkeypatch.setitem(kernels.REPLACEMENTS, Plain, WrongBackward)
    model = Wrapper()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(UsageError) as refused:
        kernels.with_kernels(model, "auto", lambda m: m(x))
    message = str(refused.value)
    assert f"{__name__}.WrongBackward at 'first'" in message, message
    assert "gradient of its parameter weight" in message and "with gradient" in message, message
    assert "differs by 1 " in message, message  # |2g - g| / |g|
    model = Wrapper()  # the same fast path under plain: nothing swapped, nothing proven
    assert kernels.with_kernels(model, "plain", lambda m: m(x)) == [] and type(model.first) is Plain


def test_a_fast_path_that_computes_what_the_model_does_passes_within_rounding(monkeypatch):
    class Reordered(Plain):  # the same product, summed in another order: rounding only
        def forward(self, x):
            return (x.flip(-1).unsqueeze(1) * self.weight.flip(1).unsqueeze(0)).sum(-1)

    monkeypatch.setitem(kernels.REPLACEMENTS, Plain, Reordered)
    model = Wrapper()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    assert kernels.with_kernels(model, "auto", lambda m: m(x)) == ["first"]
    assert type(model.first) is Reordered


HRM_512 = ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "16", "--aug", "1", "--val-puzzles", "4",
           "--test-puzzles", "4", "--max-blanks", "8", "--hidden", "512", "--heads", "8", "--h-layers", "1",
           "--l-layers", "1", "--batch-size", "4", "--halt-max-steps", "2", "--max-steps", "2", "--threads", "1",
           "--log-with", "csv", "--checkpoint-every", "2"]


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
def test_the_hrm_recipe_refuses_an_edited_attention_under_auto_and_trains_it_under_plain(tmp_path):
    """The researcher's edit made in a copy of the model file (`attended * 0.5` after the attention), the recipe run
    on it at hidden 512: --kernels auto stops at the start with one line naming the attention's fast path, exit 2,
    and no run directory; --kernels plain trains the edit (other weights than the unedited model's plain run), and
    config.json records the choice."""
    edited = tmp_path / "edited"
    shutil.copytree(ROOT / "toolkit", edited / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
    model_file = edited / "toolkit" / "models" / "hrm.py"
    line = "        attended = F.scaled_dot_product_attention(q, k, v, is_causal=False)\n"
    source = model_file.read_text()
    assert source.count(line) == 1
    model_file.write_text(source.replace(line, line + "        attended = attended * 0.5\n"))
    on_edit = {"PYTHONPATH": str(edited)}

    refused = run_recipe([*HRM_512, "--output-dir", str(tmp_path / "auto")], recipe="hrm", env=on_edit, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "toolkit.kernels.hrm.Attention at 'l_level.blocks.0.attention'" in errors[0], errors
    assert not (tmp_path / "auto").exists()

    def weights(name: str, env: dict | None) -> dict:
        from safetensors.torch import load_file

        run_recipe([*HRM_512, "--kernels", "plain", "--output-dir", str(tmp_path / name)], recipe="hrm", env=env)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["config"]["kernels"] == "plain"
        return load_file(next((tmp_path / name / "checkpoints" / "step_2").glob("model*.safetensors")))

    trained_edit, trained_as_shipped = weights("plain-edited", on_edit), weights("plain", None)
    assert trained_edit.keys() == trained_as_shipped.keys()
    differing = [k for k in trained_edit if not torch.equal(trained_edit[k], trained_as_shipped[k])]
    assert any("attention" in k for k in differing), differing


def test_a_run_made_before_the_flag_resumes_as_auto(tmp_path):
    from toolkit.run.config import changed_flags

    assert changed_flags({"lr": 0.1}, {"lr": 0.1, "kernels": "auto"}) == []
    assert changed_flags({"lr": 0.1}, {"lr": 0.1, "kernels": "plain"}) == ["--kernels 'auto' -> 'plain'"]


def test_every_kernels_module_a_model_file_names_exists_and_registers_its_paths():
    for model_file in sorted((ROOT / "toolkit" / "models").glob("*.py")):
        source = model_file.read_text()
        if "FAST_PATHS = " not in source:
            continue
        named = source.split('FAST_PATHS = "', 1)[1].split('"', 1)[0]
        module = __import__(named, fromlist=["_"])
        assert any(fast.__module__ == module.__name__ for fast in kernels.REPLACEMENTS.values()), named
        assert Path(module.__file__).parent == ROOT / "toolkit" / "kernels"
