"""toolkit.run.accelerator.ToolkitAccelerator: Accelerate's backward without its division by 1 (two launches a step)."""

from __future__ import annotations

import collections

import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.run.accelerator import ToolkitAccelerator


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def gradients(accelerator_class, accumulate: int) -> tuple[list[torch.Tensor], collections.Counter]:
    torch.manual_seed(0)
    accelerator = accelerator_class(cpu=True, gradient_accumulation_steps=accumulate)
    model = accelerator.prepare(torch.nn.Linear(5, 3))
    loss = model(torch.randn(7, 5)).pow(2).mean()
    with Ops() as ops:
        accelerator.backward(loss)
    return [p.grad.clone() for p in model.parameters()], ops.names


def test_the_same_gradients_without_the_division_by_one():
    for accumulate in (1, 3):
        ours, our_ops = gradients(ToolkitAccelerator, accumulate)
        theirs, their_ops = gradients(Accelerator, accumulate)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        if accumulate == 1:
            assert their_ops["div"] - our_ops["div"] == 2  # the loss / 1 and its gradient's, nothing else
            assert sum(their_ops.values()) - sum(our_ops.values()) == 2
        else:  # accumulation: Accelerate's own backward, its division included
            assert our_ops == their_ops
