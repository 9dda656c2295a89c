"""A model with torch's own dropout is named in one line at the start of a run: its masks differ by rank."""

from __future__ import annotations

import torch

from tests.conftest import TOY, run_recipe
from toolkit.run.randomness import KeyedDropout, rank_dependent_dropout, rank_dependent_dropout_line


def test_torch_dropout_is_found_by_name_and_keyed_or_disabled_dropout_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), KeyedDropout(0.1, batch_dim=0),
                                torch.nn.Sequential(torch.nn.Dropout2d(0.3), torch.nn.Dropout(0.0)))
    assert rank_dependent_dropout(model) == ["1", "3.0"]
    line = rank_dependent_dropout_line(model)
    assert line.startswith("warning: the model uses torch.nn dropout (1, 3.0): ") and "KeyedDropout" in line
    assert "\n" not in line
    assert rank_dependent_dropout_line(torch.nn.Sequential(torch.nn.Linear(2, 2), KeyedDropout(0.5, batch_dim=0))) \
        is None
    many = torch.nn.Sequential(*[torch.nn.Dropout(0.1) for _ in range(5)])
    assert "(0, 1, 2 and 2 more)" in rank_dependent_dropout_line(many)


def test_the_internal_dropout_of_recurrent_and_attention_modules_is_named():
    """nn.GRU(dropout=p) and nn.MultiheadAttention (inside every nn.Transformer* layer) hold their dropout as a
    number, not a module: a GRU with dropout=0.2 drifted 0.055 between 1 and 2 processes without a word."""
    gru = torch.nn.GRU(4, 8, num_layers=2, dropout=0.2)
    assert rank_dependent_dropout(gru) == ["GRU (GRU's dropout=0.2)"]
    model = torch.nn.ModuleDict({"rnn": torch.nn.LSTM(4, 8, num_layers=2, dropout=0.1), "quiet": torch.nn.GRU(4, 8),
                                 "layer": torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1)})
    assert rank_dependent_dropout(model) == ["rnn (LSTM's dropout=0.1)", "layer.self_attn (MultiheadAttention's "
                                             "dropout=0.1)", "layer.dropout", "layer.dropout1", "layer.dropout2"]
    assert rank_dependent_dropout(torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)) == []


def test_a_run_says_it_once_and_the_recipes_do_not(tmp_path):
    plain = run_recipe(["--plain-dropout", "--max-steps", "2", "--output-dir", str(tmp_path / "plain")], recipe=TOY)
    lines = [line for line in plain.stdout.splitlines() if "torch.nn dropout" in line]
    assert len(lines) == 1 and "(2)" in lines[0], plain.stdout
    keyed = run_recipe(["--max-steps", "2", "--output-dir", str(tmp_path / "keyed")], recipe=TOY)
    assert "torch.nn dropout" not in keyed.stdout + keyed.stderr
