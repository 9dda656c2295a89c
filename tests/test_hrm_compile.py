"""HRM under --compile, as the recipe compiles it (toolkit.run.compilation.compile_in_place: Module._call_impl traced
from
a frame of ours, called by HRM.__call__): one graph without breaks in training (the exploration key, the puzzle
embedding's leaf, the target-Q segment) and in evaluation; no recompilation from one step to the next (the step
number is in the exploration key); and the compiled steps compute what the eager ones do, gradients included.

Before: the puzzle embedding's leaf made inside the forward (requires_grad_) broke the training call into 6 graphs
and the step number recompiled a graph every step."""

from __future__ import annotations

import copy

import pytest
import torch
from test_hrm_model import batch, tiny_model
from torch._dynamo.testing import CompileCounterWithBackend

from toolkit.models.hrm import SparseSignSGD, act_losses
from toolkit.run import compilation


def compiled_arguments(model, *args, **kwargs) -> tuple[tuple, dict]:
    """What HRM.__call__ hands the compiled function for this call (the host's part done: the key hashed)."""
    seen = {}

    def capture(*a, **k):
        seen["args"], seen["kwargs"] = a, k
        return model._call_impl(*a, **k)

    model._compiled_call_impl = capture
    try:
        model(*args, **kwargs)
    finally:
        model._compiled_call_impl = None
    return seen["args"], seen["kwargs"]


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_compile_traces_the_whole_call_as_one_graph(positions):
    model = tiny_model(exploration_prob=0.5, positions=positions).train()
    data = batch()

    def call(*args, **kwargs):  # compile_in_place's
        return model._call_impl(*args, **kwargs)

    args, kwargs = compiled_arguments(model, model.initial_carry(data), data, explore_key=(0, 11, 1))
    explained = torch._dynamo.explain(call)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]
    model.eval()
    with torch.no_grad():
        args, kwargs = compiled_arguments(model, model.initial_carry(data), data)
        explained = torch._dynamo.explain(call)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]


def test_compiled_steps_do_not_recompile_and_match_eager(monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd, as inductor gets it
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, **{**options, "backend": counter}))
    eager = tiny_model(exploration_prob=0.5).train()
    compiled = copy.deepcopy(eager)
    compilation.compile_in_place(compiled)
    carries = {}
    for step in range(1, 5):  # new puzzles, a new step number, the carry of the step before
        data = batch(first_id=4 * step)
        seen = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            carry = carries.get(name) or model.initial_carry(data)
            out = model(carry, data, explore_key=(0, 11, step))
            loss, sums = act_losses(out)
            loss.backward()
            embedding = model.puzzle_emb
            seen[name] = (loss.detach(), embedding.batch_rows.grad.clone(), embedding.batch_ids,
                          [p.grad.clone() for p in model.parameters()], out["carry"], sums)
            SparseSignSGD(embedding, lr=0.01, weight_decay=0.1).step()  # the embedding trained as in the recipe
            SparseSignSGD(embedding, lr=0.01, weight_decay=0.1).zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            carries[name] = out["carry"]
        (loss, rows_grad, ids, grads, carry, sums), expected = seen["compiled"], seen["eager"]
        torch.testing.assert_close(loss, expected[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(rows_grad, expected[1], rtol=1e-5, atol=1e-7)
        assert torch.equal(ids, expected[2])
        for got, want in zip(grads, expected[3], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert carry["halted"].tolist() == expected[4]["halted"].tolist(), step  # the same halting decisions
        assert torch.equal(carry["steps"], expected[4]["steps"]) and torch.equal(carry["data_ids"],
                                                                                 expected[4]["data_ids"])
        torch.testing.assert_close(sums["count"], expected[5]["count"])
        assert counter.frame_count == 1, (step, counter.frame_count)  # compiled once, never again
    torch.testing.assert_close(compiled.puzzle_emb.table, eager.puzzle_emb.table, rtol=1e-5, atol=1e-6)
    assert any(flags for flags in carries["eager"]["halted"].tolist())  # rows halted and were replaced
    compiled.eval()
    with torch.no_grad():
        for _ in range(2):
            compiled(carries["compiled"], batch())
    assert counter.frame_count == 2  # evaluation: its own graph, once
