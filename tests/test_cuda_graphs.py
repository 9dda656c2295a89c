"""--cuda-graphs on the parts a CPU can run: the line that names graphs left uncaptured (inductor does not capture a
CPU graph, so a compile with mode="reduce-overhead" here is a run whose every graph was refused), the losses kept as
copies (a graph's output is overwritten by its next replay), and the flag refused on CPU (tests/test_bad_inputs.py)."""

from __future__ import annotations

import torch

from toolkit.loop.losses import StepLosses
from toolkit.run import compilation


def test_graphs_left_uncaptured_are_counted_in_one_line(tmp_path):
    torch._dynamo.reset()
    compilation.use_run_cache(tmp_path)  # the counters' baseline: this run's start
    assert compilation.describe_capture() is None  # nothing compiled yet: nothing to say
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    compilation.compile_in_place(model, mode="reduce-overhead")
    model(torch.randn(16, 4)).pow(2).mean().backward()
    line = compilation.describe_capture()
    assert line is not None and line.startswith("--cuda-graphs: ") and "TORCH_LOGS=cudagraphs" in line, line
    skipped = int(line.split(": ")[1].split()[0])
    assert skipped >= 1, line  # the forward+backward, a CPU graph (inductor counts it once)
    compilation.use_run_cache(tmp_path)  # a later run in this process starts its own count
    assert compilation.describe_capture() is None


def test_a_recorded_loss_survives_its_tensor_being_overwritten():
    for copy, expected in ((True, 1.5), (False, 9.0)):
        losses = StepLosses(read_every=2, copy=copy)
        output = torch.tensor(1.5)  # a graph's output: the next replay writes into the same memory
        losses.record(output)
        output.fill_(9.0)
        losses.close_step(1, 0)
        (step,), _ = losses.read()
        assert step.micro_batches == [expected]
