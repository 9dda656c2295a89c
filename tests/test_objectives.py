"""Each recipe's training objective against a hand computation.

On a small batch of known values, with missing readings (DCRNN), padding positions (SASRec), ignored cells and
blanks (HRM) and land / low-latitude cells (UFS), the loss each recipe backpropagates equals a formula written out
here in plain Python floats. Each test fails when a masked entry is counted, a mean is taken over the wrong count or
the targets are normalised wrongly. The recipes' losses are module-level functions their training closures call.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import xarray as xr
from accelerate import Accelerator
from conftest import load_recipe

from toolkit.data.traffic import Scaler
from toolkit.data.ufs import load_patterns
from toolkit.models.hrm import IGNORE_LABEL, act_losses
from toolkit.models.sasrec import SASRec
from toolkit.models.ufs_emulator import UfsEmulator


@functools.cache
def recipe(name: str):
    """recipes/<name>.py imported as a module (its main() is not run)."""
    return load_recipe(name, f"objectives_test_{name}")


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


class TwoRanks:
    """Stands in for rank 0 of a 2-process Accelerator: reduce(sum) adds the other rank's (loss sum, count)."""

    num_processes = 2

    def __init__(self, other_sum: float, other_count: int):
        self.other = torch.tensor([other_sum, float(other_count)])

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor + self.other


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


# ---- DCRNN: masked MAE in mph ---------------------------------------------------------------------------------

MEAN_MPH, STD_MPH = 50.0, 10.0  # the scaler: the network predicts (mph - 50) / 10
READINGS = [[60.0, None, 45.0], [None, 70.5, 52.0]]  # None: a missing reading, stored as 0 mph
SCALED = [[1.25, -0.5, -0.25], [0.75, 2.0, 0.125]]  # the network's output; 62.5 45 47.5 / 57.5 70 51.25 mph


def dcrnn_batch():
    truth = torch.tensor([[0.0 if r is None else r for r in row] for row in READINGS])
    return torch.tensor(SCALED, requires_grad=True), truth


def test_dcrnn_trains_on_the_mae_in_mph_over_the_readings_present(accelerator):
    scaled, truth = dcrnn_batch()
    loss, value = recipe("dcrnn").masked_mae(scaled, truth, Scaler(MEAN_MPH, STD_MPH), accelerator)
    errors = {}  # (row, column) -> predicted - truth in mph, for the readings present
    for i, (zs, readings) in enumerate(zip(SCALED, READINGS, strict=True)):
        for j, (z, reading) in enumerate(zip(zs, readings, strict=True)):
            if reading is not None:
                errors[i, j] = z * STD_MPH + MEAN_MPH - reading
    expected = sum(abs(e) for e in errors.values()) / len(errors)
    assert expected == (2.5 + 2.5 + 0.5 + 0.75) / 4  # the values above are exact in float32
    assert loss.item() == expected and value.item() == expected
    loss.backward()  # missing readings get no gradient; the others sign(error) x std / readings present
    expected_grad = [
        [math.copysign(STD_MPH / len(errors), errors[i, j]) if (i, j) in errors else 0.0 for j in range(3)]
        for i in range(2)
    ]
    assert scaled.grad.tolist() == expected_grad


def test_dcrnn_mae_is_the_mean_over_the_global_batchs_readings():
    """With 2 processes the value is (sum of |error|, all ranks) / (readings present, all ranks), and each rank's loss
    is scaled so that DDP's average of the two gradients is that global mean's gradient."""
    scaled, truth = dcrnn_batch()
    other_sum, other_count = 10.0, 6  # the other rank: 6 readings present, |errors| summing to 10 mph
    loss, value = recipe("dcrnn").masked_mae(scaled, truth, Scaler(MEAN_MPH, STD_MPH), TwoRanks(other_sum, other_count))
    local_sum = 2.5 + 2.5 + 0.5 + 0.75  # this rank's 4 readings present
    assert value.item() == (local_sum + other_sum) / (4 + other_count)
    assert loss.item() == pytest.approx(local_sum * 2 / (4 + other_count), rel=1e-7)


# ---- SASRec: BCE of target and sampled negative, or CE over all items; padding left out -----------------------

# Items 0..6, hidden 2; row 0 (padding) is non-zero here, so that scoring it would show.
EMBEDDINGS = [[0.5, -0.5], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.5], [0.5, 0.5], [-0.5, -1.0], [0.25, -0.75]]
HIDDEN = [[[0.3, 0.1], [1.0, -0.5], [0.5, 1.5]], [[2.0, 2.0], [-1.0, -1.0], [0.25, 0.75]]]  # [users, positions, d]
TARGETS = [[0, 2, 5], [0, 0, 3]]  # 0: padding (histories are padded on the left)
NEGATIVES = [[4, 1, 6], [2, 6, 1]]  # the sampler draws one at every position, padding included


def sasrec_batch():
    scorer = SASRec(len(EMBEDDINGS) - 1, hidden=2, blocks=1, heads=1, maxlen=3, dropout=0.0)
    with torch.no_grad():
        scorer.item_embedding.weight.copy_(torch.tensor(EMBEDDINGS))
    return scorer, torch.tensor(HIDDEN, requires_grad=True), torch.tensor(TARGETS), torch.tensor(NEGATIVES)


def target_positions():
    return [(u, t) for u in range(len(TARGETS)) for t in range(len(TARGETS[u])) if TARGETS[u][t] != 0]


def assert_padding_gets_no_gradient(hidden):
    for u, row in enumerate(TARGETS):
        for t, target in enumerate(row):
            assert (hidden.grad[u, t].abs().sum().item() == 0) == (target == 0), (u, t)


def test_sasrec_trains_on_bce_of_target_and_negative_summed_then_meaned_over_the_targets(accelerator):
    scorer, hidden, targets, negatives = sasrec_batch()
    loss, value = recipe("sasrec").next_item_loss(scorer, hidden, targets, negatives, accelerator)
    per_position = []
    for u, t in target_positions():
        h = HIDDEN[u][t]
        positive, negative = dot(h, EMBEDDINGS[TARGETS[u][t]]), dot(h, EMBEDDINGS[NEGATIVES[u][t]])
        per_position.append(-log_sigmoid(positive) - log_sigmoid(-negative))  # -log s(pos) - log(1 - s(neg))
    expected = sum(per_position) / len(per_position)  # 3 targets: the 3 padding positions are not counted
    torch.testing.assert_close(loss.item(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(value.item(), expected, rtol=1e-6, atol=0)
    loss.backward()
    assert_padding_gets_no_gradient(hidden)


def test_sasrec_full_softmax_trains_on_ce_over_the_real_items_meaned_over_the_targets(accelerator):
    scorer, hidden, targets, _ = sasrec_batch()
    loss, value = recipe("sasrec").next_item_loss(scorer, hidden, targets, None, accelerator)
    per_position = []
    for u, t in target_positions():
        scores = [dot(HIDDEN[u][t], EMBEDDINGS[item]) for item in range(1, len(EMBEDDINGS))]  # item 0 never competes
        per_position.append(math.log(sum(math.exp(s) for s in scores)) - scores[TARGETS[u][t] - 1])
    expected = sum(per_position) / len(per_position)
    torch.testing.assert_close(loss.item(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(value.item(), expected, rtol=1e-6, atol=0)
    loss.backward()
    assert_padding_gets_no_gradient(hidden)


# ---- HRM: LM loss (stablemax or softmax) per row over labelled cells, Q-halt and Q-continue BCE -------------------

I = IGNORE_LABEL  # noqa: E741
LABELS = [[2, 3, 4, 1], [2, 3, I, 4], [I, 3, 2, 4], [I, I, I, I]]  # row 3: no labelled cell
PREDICTED = [[2, 3, 4, 1], [2, 3, 0, 0], [0, 3, 2, 4], [1, 1, 1, 1]]  # argmax of the logits below
# Row 0 is exactly right; row 1 is wrong in a labelled cell; row 2 only in an ignored one, so it is exactly right;
# row 3 has nothing to get wrong. Blanks (input cells to fill) are labelled cells like the given ones.
BLANKS = [[True, False, False, True], [False, True, False, False], [False, False, True, False], [False] * 4]
Q_HALT, Q_CONTINUE, TARGET_Q_CONTINUE = [1.5, -0.5, 0.25, -2.0], [0.5, -1.0, 2.0, 0.0], [0.75, 0.25, 0.5, 1.0]
VOCAB_SIZE = 5


def hrm_logit(row: int, cell: int, token: int) -> float:
    """2.5 for the predicted token, else one of -1.5 .. 0.5 (both branches of stablemax's s(x)); exact in float32."""
    return 2.5 if token == PREDICTED[row][cell] else -1.5 + 0.5 * ((row + 2 * cell + 3 * token) % 5)


def hrm_outputs(rows: list[int]) -> dict:
    """What the model hands act_losses for these rows (a training segment: target_q_continue given)."""
    logits = [[[hrm_logit(r, c, v) for v in range(VOCAB_SIZE)] for c in range(4)] for r in rows]
    return {
        "logits": torch.tensor(logits),
        "labels": torch.tensor([LABELS[r] for r in rows]),
        "blanks": torch.tensor([BLANKS[r] for r in rows]),
        "q_halt": torch.tensor([Q_HALT[r] for r in rows]),
        "q_continue": torch.tensor([Q_CONTINUE[r] for r in rows]),
        "target_q_continue": torch.tensor([TARGET_Q_CONTINUE[r] for r in rows]),
        "halted": torch.tensor([True, False, True, False])[rows],
        "steps": torch.tensor([2, 1, 3, 1])[rows],
    }


def hand_cross_entropy(logits: list[float], label: int, loss: str) -> float:
    if loss == "stablemax":
        s = [1.0 / (1.0 - x) if x < 0 else x + 1.0 for x in logits]
        return -math.log(s[label] / sum(s))
    return -math.log(math.exp(logits[label]) / sum(math.exp(x) for x in logits))


def hand_bce(logit: float, target: float) -> float:
    return -(target * log_sigmoid(logit) + (1.0 - target) * log_sigmoid(-logit))


def hand_act_terms(rows: list[int], loss: str) -> tuple[float, float, float]:
    """(LM loss, Q-halt BCE, Q-continue BCE), each summed over the rows."""
    lm = q_halt = q_continue = 0.0
    for r in rows:
        labelled = [c for c in range(4) if LABELS[r][c] != IGNORE_LABEL]
        if labelled:  # the mean over the row's labelled cells; a row without any adds 0
            lm += sum(
                hand_cross_entropy([hrm_logit(r, c, v) for v in range(VOCAB_SIZE)], LABELS[r][c], loss)
                for c in labelled
            ) / len(labelled)
        exactly_right = all(PREDICTED[r][c] == LABELS[r][c] for c in labelled)
        q_halt += hand_bce(Q_HALT[r], 1.0 if exactly_right else 0.0)
        q_continue += hand_bce(Q_CONTINUE[r], TARGET_Q_CONTINUE[r])
    return lm, q_halt, q_continue


@pytest.mark.parametrize("loss", ["stablemax", "softmax"])
def test_hrm_trains_on_the_lm_loss_over_labelled_cells_and_half_the_q_losses_per_row(loss):
    rows = [0, 1, 2, 3]
    exactly_right = [all(PREDICTED[r][c] == LABELS[r][c] for c in range(4) if LABELS[r][c] != I) for r in rows]
    assert exactly_right == [True, False, True, True]  # the targets of Q-halt
    total, sums = act_losses(hrm_outputs(rows), loss)
    lm, q_halt, q_continue = hand_act_terms(rows, loss)
    for name, expected in [("lm_loss", lm), ("q_halt_loss", q_halt), ("q_continue_loss", q_continue)]:
        torch.testing.assert_close(sums[name].item(), expected, rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(total.item(), lm + 0.5 * (q_halt + q_continue), rtol=1e-6, atol=0)
    # The recipe backpropagates the mean per row of the batch (4 rows, one process).
    trained = recipe("hrm").per_row_loss(total, 1, len(rows))
    torch.testing.assert_close(trained.item(), (lm + 0.5 * (q_halt + q_continue)) / len(rows), rtol=1e-6, atol=0)


def test_hrm_two_ranks_backpropagate_the_mean_per_row_of_the_global_batch():
    """Rows 0-1 on rank 0, rows 2-3 on rank 1: DDP's average of the two ranks' losses is the global mean per row."""
    hrm = recipe("hrm")
    ranks = [hrm.per_row_loss(act_losses(hrm_outputs(rows))[0], 2, 4).item() for rows in ([0, 1], [2, 3])]
    lm, q_halt, q_continue = hand_act_terms([0, 1, 2, 3], "stablemax")
    torch.testing.assert_close(sum(ranks) / 2, (lm + 0.5 * (q_halt + q_continue)) / 4, rtol=1e-6, atol=0)


# ---- UFS emulator: MSE on targets normalised by the training patterns' statistics ---------------------------------

NLAT, NLON = 4, 4
LATITUDE = [30.0, 50.0, 60.0, 70.0]  # per grid row: row 0 is south of --min-abs-lat 40, outside the domain
LAND = {(1, 1), (2, 2), (3, 0)}  # tmask 0
UFS_INPUTS, UFS_OUTPUTS = ["sst", "hi"], ["aice", "hs"]
UNITS = {"sst": "K", "hi": "m", "aice": "1", "hs": "m"}


def raw_value(name: str, cell: int) -> float:
    """Every cell's physical value, land and low latitudes included (plausible values: a leak would change the
    statistics, not be refused); sst is different in every cell, so a pattern's sst names its cell."""
    return {
        "sst": 260.0 + 1.5 * cell,
        "hi": 0.1 * ((7 * cell) % 11),
        "aice": ((3 * cell) % 8) / 8,
        "hs": 0.05 * ((5 * cell) % 9),
    }[name]


def write_grid(path):
    cells = np.arange(NLAT * NLON).reshape(NLAT, NLON)
    fields = {
        name: (("nj", "ni"), np.vectorize(lambda c, name=name: raw_value(name, c))(cells), {"units": UNITS[name]})
        for name in UFS_INPUTS + UFS_OUTPUTS
    }
    tmask = np.array([[0.0 if (i, j) in LAND else 1.0 for j in range(NLON)] for i in range(NLAT)])
    tlat = np.repeat(np.array(LATITUDE)[:, None], NLON, axis=1)
    xr.Dataset({**fields, "tmask": (("nj", "ni"), tmask), "TLAT": (("nj", "ni"), tlat)}).to_netcdf(path)
    return path


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """The population mean and std (what the recipe normalises by)."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def test_ufs_trains_on_the_mse_of_targets_normalised_by_the_training_patterns_statistics(accelerator, tmp_path):
    ufs = recipe("ufs_emulator")
    patterns = load_patterns(
        accelerator,
        write_grid(tmp_path / "grid.nc"),
        inputs=UFS_INPUTS,
        outputs=UFS_OUTPUTS,
        min_abs_lat=40.0,
        val_fraction=0.3,
        seed=0,
    )
    domain = [i * NLON + j for i in range(NLAT) for j in range(NLON) if LATITUDE[i] >= 40 and (i, j) not in LAND]
    cell_of = {raw_value("sst", cell): cell for cell in range(NLAT * NLON)}
    train_cells = [cell_of[sst] for sst in patterns.train_inputs[:, 0].tolist()]
    valid_cells = [cell_of[sst] for sst in patterns.valid_inputs[:, 0].tolist()]
    assert sorted(train_cells + valid_cells) == domain  # every ocean cell poleward of 40, no land, each once
    assert len(train_cells) >= 3 and valid_cells

    stats = {name: mean_and_std([raw_value(name, c) for c in train_cells]) for name in UFS_INPUTS + UFS_OUTPUTS}

    def normalised(names, cell):
        return [(raw_value(name, cell) - stats[name][0]) / stats[name][1] for name in names]

    torch.manual_seed(0)
    model = UfsEmulator(
        patterns.input_mean, patterns.input_std, patterns.output_mean, patterns.output_std, hidden=8, layers=2
    )
    rows = ufs.training_rows(model, patterns)
    loss = ufs.normalised_mse(model(rows["x"]), rows["y"])

    hand_y = [normalised(UFS_OUTPUTS, cell) for cell in train_cells]
    torch.testing.assert_close(rows["y"], torch.tensor(hand_y), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the same network on inputs normalised by hand
        out = model(torch.tensor([normalised(UFS_INPUTS, cell) for cell in train_cells])).tolist()
    squared = [
        (o - y) ** 2 for out_row, y_row in zip(out, hand_y, strict=True) for o, y in zip(out_row, y_row, strict=True)
    ]
    torch.testing.assert_close(loss.item(), sum(squared) / len(squared), rtol=1e-5, atol=0)
