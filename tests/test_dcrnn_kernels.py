"""DCRNN's fast paths (toolkit/kernels/dcrnn.py) under toolkit.kernels: swapped in without touching the model's
state, proven equal to the model file's code at the start (the fused kernel on CPU too, and under bf16 autocast),
an edit to the model file's cells or diffusion that a fast path does not know refused naming it, and a proof that
leaves the training after it as it would have been without it (the fused kernel's pooled buffers and caches)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from toolkit import kernels
from toolkit.errors import UsageError
from toolkit.kernels import dcrnn as dcrnn_kernels
from toolkit.models import dcrnn

torch.set_num_threads(1)  # tiny tensors, a busy machine
RING = np.eye(20) + np.roll(np.eye(20), 1, axis=1)  # each sensor feeds the next: sparse diffusion operators


def make(sequence_kernel: str, seed: int = 0) -> dcrnn.DCRNN:
    torch.manual_seed(seed)
    return dcrnn.DCRNN(RING, units=4, layers=2, sequence_kernel=sequence_kernel)


def example(model: dcrnn.DCRNN):
    """As the recipe proves: two samples with teacher values and coins, the truth fed at every other decoder step."""
    generator = torch.Generator().manual_seed(1)
    x, teacher = torch.randn(2, 12, 20, 2, generator=generator), torch.randn(2, 12, 20, generator=generator)
    coins = (torch.arange(12)[None, :] + torch.arange(2)[:, None]) % 2 == 0
    return model(x, teacher, coins)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("sequence_kernel", ["fused", "cells"])
def test_with_kernels_proves_the_fast_paths_on_cpu_and_keeps_the_state(sequence_kernel, autocast):
    # Under bf16 autocast the fused kernel's products, and on CPU the diffusion's sparse ones (the model file's in
    # float32: autocast's bf16 sparse product fails in its backward), round in bf16 in another order than the model
    # file's code: measured <= 6e-3 (relative, seeds 0-5), held to bf16's rounding (5e-2)
    model = make(sequence_kernel)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = [name for name, _ in model.named_buffers()]
    within = (functools.partial(torch.autocast, "cpu", dtype=autocast) if autocast else contextlib.nullcontext)
    assert kernels.with_kernels(model, "plain", example) == []
    assert type(model) is dcrnn.DCRNN
    swapped = kernels.with_kernels(model, "auto", example, autocast=within)
    # the fused kernel is swapped in where it runs (asked for, or on CUDA); on a CPU's cells the model stays as written
    fused = sequence_kernel == "fused"
    assert swapped == (["DCRNN", "diffusion"] if fused else ["diffusion"])
    assert (type(model) is dcrnn_kernels.DCRNN) == fused and type(model.diffusion) is dcrnn_kernels.GraphDiffusion
    assert all(type(cell.gates.diffusion) is dcrnn_kernels.GraphDiffusion for cell in model.encoder)  # one, shared
    assert model.state_dict().keys() == state.keys() and [name for name, _ in model.named_buffers()] == buffers
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())


def train(model: dcrnn.DCRNN, batches: list[int]) -> dict[str, torch.Tensor]:
    """Adam steps with the given batch sizes (forcing coins on): the weights after them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    generator = torch.Generator().manual_seed(2)
    for batch in batches:
        x, y = torch.randn(batch, 12, 20, 2, generator=generator), torch.randn(batch, 12, 20, generator=generator)
        coins = torch.rand(batch, 12, generator=generator) < 0.5
        (model(x, y, coins) - y).abs().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_proof_leaves_the_training_after_it_bit_for_bit_as_without_it():
    # The proof runs the fused kernel on two samples: its pool keeps that run's buffers, its operators and scratch
    # buffers are made. Steps after it (of the proof's batch size, whose buffers the pool then serves, and of
    # others) end with the weights of the same steps on a model converted without a proof.
    proven, converted = make("fused"), make("fused")
    kernels.with_kernels(proven, "auto", example)
    assert dcrnn_kernels._state(proven).pool  # the proof's buffers are in the pool
    kernels.convert(converted)
    after, expected = train(proven, [2, 4, 2]), train(converted, [2, 4, 2])
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def halved(monkeypatch, cls, method: str) -> None:
    """The edit a researcher makes to the model file: `cls.method`'s result halved."""
    plain = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args: plain(self, *args) * 0.5)


def test_an_edit_to_the_cells_is_refused_under_auto_with_the_fused_kernel_and_trained_with_plain(monkeypatch):
    halved(monkeypatch, dcrnn.DCGRUCell, "step")  # each cell's new state halved
    with pytest.raises(UsageError) as refused:
        kernels.with_kernels(make("fused"), "auto", example)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--kernels auto: toolkit.kernels.dcrnn.DCRNN at 'DCRNN', the fast "
                                                "path of toolkit.models.dcrnn.DCRNN, computes another output")
    assert "give --kernels plain" in line
    model = make("fused")
    assert kernels.with_kernels(model, "plain", example) == [] and type(model) is dcrnn.DCRNN
    assert torch.isfinite(example(model)).all()  # the edited cells, as written
    # the cells under auto: the fast path runs the model file's (edited) cells too, so the proof passes
    assert kernels.with_kernels(make("cells"), "auto", example) == ["diffusion"]


def test_an_edit_to_the_diffusion_is_refused_naming_its_fast_path(monkeypatch):
    halved(monkeypatch, dcrnn.GraphDiffusion, "forward")
    for sequence_kernel, fast_path in (("cells", "GraphDiffusion at 'diffusion'"), ("fused", "DCRNN at 'DCRNN'")):
        with pytest.raises(UsageError, match=f"toolkit.kernels.dcrnn.{fast_path}, the fast path of "):
            kernels.with_kernels(make(sequence_kernel), "auto", example)
