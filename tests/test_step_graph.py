"""--cuda-graphs capturing a whole step (toolkit.run.step_graph), on the parts a CPU can run: which runs may capture and
the one line for those that may not; when the loop captures, replays, and runs uncaptured; and that the values a
captured step keys on tensors (the epoch of SASRec's negatives, KeyedDropout's generators) draw exactly what the
uncaptured step draws. Capture itself needs CUDA: benchmarks/gpu_proof.py's `graphs` check trains captured and
uncaptured side by side on a GPU and compares the weights byte for byte."""

from __future__ import annotations

import pytest
import torch
from conftest import load_recipe
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.run import randomness
from toolkit.run.config import TrainConfig
from toolkit.run.step_graph import WARMUP, StepGraph, refusal_line, whole_step_refusal


def test_which_runs_capture_the_whole_step_and_the_line_for_the_others():
    from recipes.dcrnn import DCRNNConfig
    from recipes.hrm import HRMConfig
    from recipes.sasrec import SASRecConfig
    from recipes.ufs_emulator import UfsConfig

    one = {"num_processes": 1, "mixed_precision": "bf16"}
    assert whole_step_refusal(UfsConfig(), **one) is None
    assert whole_step_refusal(SASRecConfig(), **one) is None
    assert whole_step_refusal(SASRecConfig(variant="tisasrec-mhc"), **one) is None
    assert whole_step_refusal(SASRecConfig(loss="ce"), **one) is None  # on a GPU its CE ignores the padding by index 0
    assert whole_step_refusal(DCRNNConfig(), **one) is None
    for other in (HRMConfig(), TrainConfig()):
        assert "does not give its step to loop.run_step" in whole_step_refusal(other, **one)
    assert "2 processes" in whole_step_refusal(UfsConfig(), num_processes=2, mixed_precision="no")
    assert "--grad-accum 4" in whole_step_refusal(UfsConfig(grad_accum=4), **one)
    assert "fp16" in whole_step_refusal(UfsConfig(), num_processes=1, mixed_precision="fp16")
    line = refusal_line(whole_step_refusal(UfsConfig(), num_processes=2, mixed_precision="no"))
    assert line.startswith("--cuda-graphs: the whole step is not captured (2 processes") and "\n" not in line
    assert 'mode="reduce-overhead"' in line


class RecordingGraph(StepGraph):
    """StepGraph with the capture and the replay (CUDA's) recorded instead of done: the policy around them."""

    def __init__(self):
        self.lines, self.events = [], []
        super().__init__(enabled=True, say=self.lines.append)

    def _capture(self, step, batch, signature) -> bool:
        self.events.append("capture")
        self._graph, self._signature = object(), signature
        return True

    def _replay(self, batch) -> None:
        self.events.append("replay")


def test_the_step_runs_uncaptured_until_the_optimizer_holds_still_then_replays():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    graph = RecordingGraph()

    def step(batch):
        graph.events.append("eager")
        graph.saw_optimizer(optimizer)  # as loop.optimizer_step tells it

    batch = {"x": torch.zeros(4, 3)}
    for _ in range(WARMUP + 4):
        graph.run(step, batch)
    # the first step shows the optimizer; WARMUP steady steps after it; then one capture and replays
    assert graph.events == ["eager"] * (WARMUP + 1) + ["capture", "replay", "replay", "replay"]
    assert graph.lines == []  # the real capture says its own line

    graph.events.clear()
    optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's new rate: baked into the graph, so it is dropped
    for _ in range(WARMUP + 2):
        graph.run(step, batch)
    assert graph.events == ["eager"] * WARMUP + ["capture", "replay", "replay"]
    assert len(graph.lines) == 1 and "hyperparameters changed" in graph.lines[0]

    graph.events.clear()
    optimizer.param_groups[0]["capturable"] = True  # what the real capture sets is no change: still replayed
    graph.run(step, batch)
    graph.run(step, {"x": torch.zeros(5, 3)})  # another shape: dropped, uncaptured
    assert graph.events == ["replay", "eager"]
    assert len(graph.lines) == 1  # said once a life


def test_without_the_flag_the_step_is_called_as_is():
    calls = []
    graph = StepGraph(enabled=False)
    for i in range(WARMUP + 3):
        graph.run(calls.append, {"i": i})
    assert [c["i"] for c in calls] == list(range(WARMUP + 3)) and not graph.capturing


def test_keyed_dropout_generators_are_reused_and_draw_what_a_new_generator_draws():
    # A captured step registers KeyedDropout's generators with its graph: the same objects every micro-batch,
    # reseeded per draw. Their masks must be those of a new generator seeded alike (the checkpoints' streams).
    def fresh(seed, key, call, rows, per_row, p, rank, world):
        generator = torch.Generator().manual_seed(randomness.keyed_hash_int(seed, 0xD509, key, call))
        count = rows * world * per_row
        words = torch.empty((count + 3) // 4, dtype=torch.int64)
        words.random_(-(2**63), 2**63 - 1, generator=generator)
        lanes = words.view(torch.int16)[:count].view(rows * world, per_row)[rank * rows:(rank + 1) * rows]
        return randomness.keep_from_lanes(lanes, p)

    masks = {}
    for key in (11, 12, 11):
        randomness.begin_micro_batch(seed=3, key=key, rank=1, world_size=2)
        drawn = [randomness.keyed_keep(4, 9, 0.2) for _ in range(2)]
        assert randomness.keyed_calls() == 2
        for call, mask in enumerate(drawn, start=1):
            assert torch.equal(mask, fresh(3, key, call, 4, 9, 0.2, 1, 2)), (key, call)
        masks.setdefault(key, drawn)
        assert all(torch.equal(a, b) for a, b in zip(masks[key], drawn, strict=True))
    randomness.rewind_keyed_calls(0)
    assert randomness.keyed_calls() == 0
    randomness.end_micro_batches()
    assert randomness.keyed_generators() == []  # CPU generators: none for a CUDA graph to register


def test_negatives_keyed_on_the_epoch_as_a_tensor_are_those_of_the_int():
    # SASRec's captured step keys its negatives on loop.device_epoch: the draws must not change
    touched = torch.rand(7, 41, generator=torch.Generator().manual_seed(0)) < 0.4
    sampler = randomness.UntouchedItems(touched)
    users, positions = torch.tensor([0, 3, 6, 2]), torch.arange(12)
    for epoch in (0, 1, 57):
        as_int = sampler.sample(users, positions, seed=5, purpose=2, epoch=epoch)
        as_tensor = sampler.sample(users, positions, seed=5, purpose=2, epoch=torch.tensor(epoch))
        assert torch.equal(as_int, as_tensor)
    assert not torch.equal(sampler.sample(users, positions, seed=5, purpose=2, epoch=torch.tensor(1)),
                           sampler.sample(users, positions, seed=5, purpose=2, epoch=0))


def test_an_optimizer_with_python_state_is_never_captured():
    # AdamATan2 counts its steps in a Python float: a replay would repeat the captured step's bias correction
    from toolkit.models.hrm import AdamATan2

    graph, lines, calls = _run_steps(AdamATan2, {"x": torch.zeros(2)}, WARMUP + 4)
    assert calls == WARMUP + 4 and graph.steps_replayed == 0 and not graph.enabled
    assert len(lines) == 1 and "AdamATan2 keeps Python state" in lines[0] and "runs uncaptured" in lines[0]


def _run_steps(optimizer_class, batch: dict, steps: int) -> tuple[StepGraph, list[str], int]:
    """An enabled StepGraph run `steps` times on a step that only steps an optimizer_class: (graph, lines, calls)."""
    optimizer = optimizer_class([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    lines, calls = [], []
    graph = StepGraph(enabled=True, say=lines.append)

    def step(batch):
        calls.append(1)
        graph.saw_optimizer(optimizer)

    for _ in range(steps):
        graph.run(step, batch)
    return graph, lines, len(calls)


class OpStream(TorchDispatchMode):
    """Every aten op a step dispatches, with its arguments: tensors as (shape, dtype, device), the rest as given. A
    Python value among them is what a CUDA graph bakes into its kernels at the capture."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "record_function" not in str(func):  # the profiler's marks (Optimizer.step's): no kernel
            self.ops.append((str(func), _described(args), _described(tuple(sorted(kwargs.items())))))
        return func(*args, **kwargs)


def _described(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, torch.Generator):
        return ("generator", value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_described(v) for v in value)
    if isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, type(None))):
        return value
    return type(value).__name__


@pytest.mark.parametrize("recipe", ["ufs_emulator", "sasrec", "sasrec --loss ce", "dcrnn"])
def test_a_captured_recipes_step_takes_no_python_value_that_changes_between_steps(recipe, tmp_path, monkeypatch,
                                                                                    movielens_cache, synth_data):
    # What --cuda-graphs replays is what the capture recorded: the ops and their Python arguments. Every step of the
    # recipes that capture their whole step, across an epoch's end, must dispatch the same ops with the same Python
    # values (the epoch, the seed, the learning rate ...), only the tensors' contents differing. SASRec's CE on the
    # CPU picks its targets by a boolean index (a shape per batch): its GPU path, every position scored, is the one
    # checked here.
    from toolkit.loop import training as loop_module

    recipe, *recipe_flags = recipe.split()
    module = load_recipe(recipe, f"recipe_{recipe}_streams")
    streams, epochs = [], []

    def recording_run(self, step, batch):
        with OpStream() as stream:
            step(batch)
        streams.append(stream.ops)

    monkeypatch.setattr(StepGraph, "run", recording_run)
    monkeypatch.setattr(loop_module, "AFTER_STEP_HOOKS", [lambda loop: epochs.append(loop.progress.epoch)])
    common = ["--output-dir", str(tmp_path / "run"), "--log-with", "none", "--checkpoint-every", "0", "--threads", "1"]
    if recipe == "sasrec":  # 943 users, batch 128: 7 steps an epoch
        monkeypatch.setattr(module, "SCORE_EVERY_POSITION_ON", ("cuda", "cpu"))
        flags = ["--cache-dir", str(movielens_cache), "--hidden", "8", "--blocks", "1", "--maxlen", "20",
                 "--max-steps", "10"]
    elif recipe == "dcrnn":  # its scheduled sampling's coins and probability change every step: tensors
        flags = ["--data", str(synth_data), "--cache-dir", str(tmp_path / "cache"), "--units", "8",
                 "--batch-size", "128", "--max-steps", "10"]
    else:
        from toolkit.data.ufs import synthesize

        data = synthesize(tmp_path / "ufs.nc", seed=0, nlat=24, nlon=48)
        flags = ["--data", str(data), "--hidden", "8", "--batch-size", "100", "--max-steps", "10"]
    module.main([*flags, *recipe_flags, *common])
    assert len(streams) == 10 and len(set(epochs)) >= 2, (len(streams), epochs)  # an epoch's end among them
    steady = streams[1:]  # the first step makes the optimizer's state
    for number, stream in enumerate(steady, start=2):
        assert stream == steady[0], f"step {number} dispatches other ops or Python values than step 2"
    assert any("random_" in op for op, _, _ in steady[0]) == (recipe == "sasrec")  # keyed dropout's draws


def test_a_batch_with_a_host_tensor_is_never_captured():
    # (a host tensor's value enters a CUDA kernel as an argument when it is launched: a replay would repeat it)
    graph, lines, calls = _run_steps(torch.optim.Adam, {"x": torch.zeros(2), "n": 3}, WARMUP + 3)
    assert calls == WARMUP + 3 and graph.steps_replayed == 0 and not graph.enabled
    assert lines == ["--cuda-graphs: the step is not captured: the batch's x is not on the GPU; it runs uncaptured"]
