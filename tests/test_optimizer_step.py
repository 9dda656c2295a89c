"""The step every recipe takes, once (TrainingLoop.optimizer_step): clip when the gradients sync, step, schedule,
zero, record the loss; checked against the same arithmetic written out by hand, with gradient accumulation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from toolkit.loop.losses import StepLosses
from toolkit.loop.training import TrainingLoop
from toolkit.run.step_graph import StepGraph


def stand_in_loop(accelerator, model, max_grad_norm: float) -> SimpleNamespace:
    """The attributes optimizer_step reads, without a run directory (the method is called unbound on it)."""
    loop = SimpleNamespace(accelerator=accelerator, model=model, config=SimpleNamespace(max_grad_norm=max_grad_norm),
                           losses=StepLosses(read_every=1), step_graph=StepGraph(enabled=False))
    loop.record_loss = lambda loss: TrainingLoop.record_loss(loop, loss)
    return loop


def batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(4)]


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_two_accumulated_micro_batches_clip_once_step_once_and_record_both_losses(max_grad_norm):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loop = stand_in_loop(accelerator, model, max_grad_norm)
    data = batches()
    for x, y in data:
        with accelerator.accumulate(model):
            loss = (model(x) - y).pow(2).mean()
            accelerator.backward(loss)
            TrainingLoop.optimizer_step(loop, optimizer, scheduler, rank_loss=loss)

    # By hand: each window of two micro-batches sums their gradients / 2, clips the sum once, one SGD step at the
    # scheduler's rate for that window (1, then 1/2).
    def by_hand(clip: float) -> torch.nn.Linear:
        expected = torch.nn.Linear(3, 1)
        expected.load_state_dict(start)
        for window, lr in ((data[:2], 0.5), (data[2:], 0.25)):
            expected.zero_grad()
            for x, y in window:
                ((expected(x) - y).pow(2).mean() / 2).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(expected.parameters(), clip)
            with torch.no_grad():
                for p in expected.parameters():
                    p -= lr * p.grad
        return expected

    for mine, theirs in zip(model.parameters(), by_hand(max_grad_norm).parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-7)
        assert mine.grad is None  # zeroed (set to None) after the step
    loop.losses.close_step(2, 0)
    (read,), _ = loop.losses.read()
    assert read.step == 2 and len(read.micro_batches) == 4 and all(v > 0 for v in read.micro_batches)
    if max_grad_norm:  # the clip mattered: the unclipped steps end elsewhere
        assert (by_hand(0.0).weight - model.weight).abs().max() > 1e-2


def test_exactly_one_kind_of_loss():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = stand_in_loop(accelerator, model, 0.0)
    for kwargs in ({}, {"loss": torch.tensor(1.0), "rank_loss": torch.tensor(1.0)}):
        with pytest.raises(TypeError, match="exactly one of loss="):
            TrainingLoop.optimizer_step(loop, optimizer, **kwargs)


def test_several_optimizers_each_step_in_turn_before_the_scheduler_and_each_is_zeroed():
    """optimizer_step([a, b], scheduler): HRM's AdamATan2 and its embedding's SignSGD through the public step, as
    stepping each by hand, then the scheduler (a's rate for the next step), then zeroing both."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    start = [{k: v.clone() for k, v in m.state_dict().items()} for m in (first, second)]
    model = torch.nn.ModuleList([first, second])
    accelerator = Accelerator(cpu=True)
    a = torch.optim.SGD(first.parameters(), lr=0.5)
    b = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(a, lambda step: 1.0 / (step + 1))
    model, a, b, scheduler = accelerator.prepare(model, a, b, scheduler)
    loop = stand_in_loop(accelerator, model, 0.0)
    data = batches()
    for x, y in data:
        loss = (first(x) + second(x) - y).pow(2).mean()
        accelerator.backward(loss)
        TrainingLoop.optimizer_step(loop, [a, b], scheduler, loss=loss.detach())
    assert all(p.grad is None for p in model.parameters())

    by_hand = [torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)]
    for m, state in zip(by_hand, start, strict=True):
        m.load_state_dict(state)
    hand_a = torch.optim.SGD(by_hand[0].parameters(), lr=0.5)
    hand_b = torch.optim.SGD(by_hand[1].parameters(), lr=0.1, momentum=0.9)
    hand_scheduler = torch.optim.lr_scheduler.LambdaLR(hand_a, lambda step: 1.0 / (step + 1))
    for x, y in data:
        (by_hand[0](x) + by_hand[1](x) - y).pow(2).mean().backward()
        hand_a.step(), hand_b.step(), hand_scheduler.step()
        hand_a.zero_grad(), hand_b.zero_grad()
    for mine, theirs in zip(model.parameters(), [p for m in by_hand for p in m.parameters()], strict=True):
        assert torch.equal(mine, theirs)
