"""--cuda-graphs for a whole training step: forward, backward and optimizer captured once as one CUDA graph and
replayed, so a step costs a few launches of the host instead of hundreds (on a GPU the device waited on
the host at these model sizes).

A recipe gives its step as a function of the batch and the loop runs it (UFS, SASRec, DCRNN; e.g. recipes/sasrec.py):

    def train_step(batch):
        with accelerator.accumulate(model):
            ...; accelerator.backward(loss)
            loop.optimizer_step(optimizer, scheduler, loss=loss_value)

    for batch in loop.batches():
        loop.run_step(train_step, batch)

Without --cuda-graphs (and on CPU) run_step calls the function: nothing else changes. With it:
- the first WARMUP + 1 steps of each life run uncaptured (the optimizer makes its state, cuBLAS its workspaces; a
  resumed run loads its checkpoint before any capture, so the graph holds the loaded tensors);
- then the step is captured on a copy of the batch (static inputs) and replayed: each later batch is copied into
  those tensors (one copy per tensor, on the device) and the graph replays. The loop's deferred parts run after each
  replay, on the host: the scheduler's step (its new learning rate) and the loss's record (a copy: the next replay
  overwrites the graph's loss);
- a replay runs the kernels the capture recorded, with the Python values the capture saw baked into them. What
  changes from step to step must therefore be a tensor: the batch, the epoch (loop.device_epoch), the random state
  (the global generator is reseeded per micro-batch and read by the graph at each replay; KeyedDropout's generators
  are registered with the graph and reseeded before each replay, toolkit.run.randomness). The optimizers' Python
  hyperparameters (the learning rate a scheduler sets) are watched: when one changes, the step runs uncaptured
  until they have held still for WARMUP steps, then is captured anew. A step whose batch shapes differ from the
  capture's runs uncaptured. Never captured, said in one line: a batch tensor on the host, an optimizer other than
  torch's Adam, AdamW or SGD (AdamATan2 counts its steps in Python). tests/test_step_graph.py records each step's
  ops and Python arguments across an epoch's end (all equal after the first); gpu_proof's `graphs` check trains
  captured and uncaptured side by side on a GPU and compares the weights byte for byte.

Where a whole step cannot be one graph, the model's forward and backward are captured instead (torch.compile
mode="reduce-overhead", the compiled graphs' own CUDA graphs), said in one line: several processes (DDP's all-reduce
between backward and step), gradient accumulation (a window's micro-batches are different Python paths), fp16 (the
grad scaler reads on the host whether to skip a step), a recipe that does not give its step to run_step (HRM: two
optimizers, one of them AdamATan2 with its Python step count, and a carry).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from toolkit.run import randomness

# torch's optimizers whose step keeps no Python state that changes (Adam/AdamW: the step count is a device tensor)
CAPTURE_SAFE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
WARMUP = 3  # uncaptured steps before a capture (torch's docs warm up a few iterations; the optimizer needs one)


def whole_step_refusal(config, *, num_processes: int, mixed_precision: str) -> str | None:
    """None when --cuda-graphs can capture the whole step; else why not (the run captures the model's graphs)."""
    if not config.captures_whole_step:
        return "this recipe does not give its step to loop.run_step"
    if num_processes > 1:
        return f"{num_processes} processes (DDP's gradient all-reduce runs between the backward and the step)"
    if config.grad_accum > 1:
        return f"--grad-accum {config.grad_accum} (a window's micro-batches take different Python paths)"
    if mixed_precision == "fp16":
        return "fp16 (the grad scaler decides on the host whether to skip a step)"
    return None


def refusal_line(why: str) -> str:
    return (f"--cuda-graphs: the whole step is not captured ({why}); the model's forward and backward are captured "
            "instead (torch.compile mode=\"reduce-overhead\")")


def _hyperparameters(optimizers: list[torch.optim.Optimizer]) -> tuple:
    """The optimizers' Python values a captured step bakes in (learning rate, betas, weight decay, ...)."""
    return tuple(tuple((k, v) for k, v in group.items() if k not in _NOT_BAKED and not isinstance(v, torch.Tensor))
                 for optimizer in optimizers for group in optimizer.param_groups)


_NOT_BAKED = ("params", "capturable")  # (the capture sets capturable; fused Adam's arithmetic does not read it)


def _shapes(batch: dict) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else (k, v)
                 for k, v in batch.items())


class StepGraph:
    """Runs a step function uncaptured, or captured once and replayed (see the module's docstring)."""

    def __init__(self, enabled: bool, say: Callable[[str], None] | None = None):
        self.enabled = enabled
        self.say = say or (lambda line: None)
        self.capturing = False  # the loop defers its host-side parts while this is True
        self.optimizers: list[torch.optim.Optimizer] = []  # those the step has stepped (the loop tells)
        self._deferred: list[Callable[[], None]] = []  # run after each replay
        self._graph = None
        self._static: dict | None = None
        self._signature = None  # (hyperparameters, batch shapes) the graph was captured with
        self._steady = 0  # uncaptured steps in a row with the same signature
        self._last = None
        self._keyed_calls = 0  # KeyedDropout draws in one captured step (reseeded before each replay)
        self._recaptures = 0
        self.steps_replayed = 0

    def saw_optimizer(self, optimizer) -> None:
        if self.enabled and optimizer not in self.optimizers:
            self.optimizers.append(optimizer)

    def defer(self, action: Callable[[], None]) -> None:
        """During the capture: run `action` on the host after every replay (it is not part of the graph)."""
        self._deferred.append(action)

    def run(self, step: Callable[[dict], None], batch: dict) -> None:
        if not self.enabled:
            step(batch)
            return
        signature = (_hyperparameters(self.optimizers), _shapes(batch))
        if self._graph is not None and signature != self._signature:
            self._drop(signature)
        if self._graph is None:
            self._steady = self._steady + 1 if signature == self._last else 1
            self._last = signature
            if self._steady <= WARMUP or not self.optimizers:
                step(batch)
                return
            if not self._capture(step, batch, signature):
                step(batch)
                return
        self._replay(batch)

    def _drop(self, signature) -> None:
        if self._recaptures == 0:
            changed = "the batch's shapes" if signature[1] != self._signature[1] else "an optimizer's hyperparameters"
            self.say(f"--cuda-graphs: {changed} changed; the step runs uncaptured until they hold still for "
                     f"{WARMUP} steps, then is captured again (said once)")
        self._recaptures += 1
        self._graph = self._static = self._signature = None
        self._deferred = []
        self._steady = 0

    def _capture(self, step, batch: dict, signature) -> bool:
        """Capture step(batch) (nothing runs on the device); False, said in one line, where torch refuses: the run
        goes on uncaptured (the step then runs as it would have, the micro-batch's dropout draws counted anew)."""
        began = time.perf_counter()
        unsafe = [type(o).__name__ for o in (getattr(o, "optimizer", o) for o in self.optimizers)
                  if not isinstance(o, CAPTURE_SAFE)]
        if unsafe:  # e.g. AdamATan2: its step count is a Python number, which a replay would not advance
            self.enabled = False
            self.say(f"--cuda-graphs: the step is not captured: {', '.join(unsafe)} keeps Python state a graph would "
                     f"freeze (captured: {', '.join(c.__name__ for c in CAPTURE_SAFE)}); it runs uncaptured")
            return False
        on_host = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device.type != "cuda"]
        if on_host:  # a host tensor's value would be read once, at the capture, and replayed
            self.enabled = False
            self.say(f"--cuda-graphs: the step is not captured: the batch's {', '.join(on_host)} is not on the GPU; it "
                     "runs uncaptured")
            return False
        for optimizer in self.optimizers:  # torch refuses to capture an optimizer step otherwise (same arithmetic)
            for group in optimizer.param_groups:
                if "capturable" in group:
                    group["capturable"] = True
        self._static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self._deferred = []
        self.capturing = True
        calls_before = randomness.keyed_calls()
        try:
            graph = torch.cuda.CUDAGraph()
            for generator in randomness.keyed_generators():
                graph.register_generator_state(generator)
            # thread_local: a DataLoader's pin-memory thread (--no-data-on-device) may allocate meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step(self._static)
        except Exception as error:  # e.g. an op that reads a device value on the host (a sync)
            self.enabled = False
            randomness.rewind_keyed_calls(calls_before)
            for optimizer in self.optimizers:  # gradients the capture allocated hold no values: the step starts anew
                optimizer.zero_grad(set_to_none=True)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.say(f"--cuda-graphs: the step could not be captured ({type(error).__name__}: {first[:200]}); "
                     "it runs uncaptured")
            return False
        finally:
            self.capturing = False
        self._keyed_calls = randomness.keyed_calls() - calls_before
        self._graph, self._signature = graph, signature
        if self._recaptures == 0:
            self.say(f"--cuda-graphs: the whole step (forward, backward, optimizer) captured as one CUDA graph in "
                     f"{time.perf_counter() - began:.2f} s, replayed from here on")
        return True

    def _replay(self, batch: dict) -> None:
        for name, value in batch.items():
            if isinstance(value, torch.Tensor):
                self._static[name].copy_(value)
        randomness.reseed_keyed_generators(self._keyed_calls)  # this micro-batch's dropout masks
        self._graph.replay()
        self.steps_replayed += 1
        for action in self._deferred:
            action()
