"""Fast paths kept apart from the models they speed up: swapped in by one step when a run builds its model, and
proven equal to the model's own code at every start.

A model file is the plain PyTorch a researcher reads and edits. Its fast paths (oneDNN/MKL products with
written-out backwards, chunked attention with its dropout, a fused sequence kernel) live in a kernels module that
the model file names in one line, `FAST_PATHS = "toolkit.kernels.hrm"`. There each fast path is a subclass of the
plain module it replaces, registered with `replaces`, whose forward takes the fast path where it applies and the
model's own code (`super().forward`) everywhere else:

    @replaces(hrm.Attention)
    class Attention(hrm.Attention):
        def forward(self, x, rotary, first_only=False):
            if <the CPU kernel applies>:
                return OneDNNAttention.apply(...)
            return super().forward(x, rotary, first_only)

`with_kernels(model, "auto", example)` (a recipe calls it through `Run.with_kernels`, before its loop starts)
swaps the class of each such module in place, which keeps its parameters, buffers and state_dict (a checkpoint
cannot tell), then proves the swap: the model as written and the converted model each run `example`, one batch of a
few samples at the model's own sizes on the run's device and under its autocast, forward and backward (a fixed
random projection of the outputs). Every converted module's outputs, the model's outputs and every parameter's
gradient must agree within rounding; the first that does not is one line naming the module, and the run stops with
exit status 2 before its directory is made. `"plain"` converts nothing: the code in the model file, exactly.

torchtitan's ModelConverter is the pattern (a model built plain, then converted by registered converters); the
proof at every start is ours, because here the plain code is what a researcher edits, and an edit that the fast path
does not know must not train silently.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from toolkit.errors import UsageError
from toolkit.run.randomness import begin_micro_batch, end_micro_batches

CHOICES = ("auto", "plain")

# Each registered plain class -> its fast subclass (`replaces`)
REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {}

# What the proof allows between the model as written and the converted model: the norm of the difference over the
# norm of the written model's value, by dtype. Rounding alone, summed in another order through a few layers, stays
# below these by orders of magnitude (tests/test_kernels.py); an edit's difference is of the order of the values.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def replaces(plain: type[nn.Module]) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: the decorated class is the fast path of `plain`, swapped in by `convert`. It must subclass
    `plain` and add no parameters or buffers of its own (the swap keeps the module's state as it is)."""

    def register(fast: type[nn.Module]) -> type[nn.Module]:
        if not issubclass(fast, plain):
            raise TypeError(f"{fast.__qualname__} replaces {plain.__qualname__}, so it must subclass it")
        REPLACEMENTS[plain] = fast
        return fast

    return register


def _load_fast_paths(model: nn.Module) -> None:
    """Import the kernels module each of the model's module files names (FAST_PATHS), which registers its paths."""
    for module in model.modules():
        named = getattr(sys.modules.get(type(module).__module__), "FAST_PATHS", None)
        if named:
            importlib.import_module(named)


def convert(model: nn.Module) -> dict[str, tuple[type[nn.Module], type[nn.Module]]]:
    """Swap in the fast paths, in place: {module name: (plain class, fast class)} of the modules swapped."""
    _load_fast_paths(model)
    swapped = {}
    for name, module in model.named_modules():
        fast = REPLACEMENTS.get(type(module))
        if fast is not None:
            swapped[name or type(model).__name__] = (type(module), fast)
            module.__class__ = fast
    return swapped


def converted(model: nn.Module) -> nn.Module:
    """The model with its fast paths swapped in (in place), unproven: what --kernels auto trains once its proof has
    passed, for benchmarks and tests that time or test the fast paths themselves."""
    convert(model)
    return model


def _set_classes(model: nn.Module, swapped: dict, which: int) -> None:
    """Every swapped module back to its plain class (which=0) or to its fast one (1)."""
    modules = dict(model.named_modules())
    for name, classes in swapped.items():
        (modules.get(name) or model).__class__ = classes[which]


def _floats(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for key in value for t in _floats(value[key])]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floats(item)]
    return []


def _difference(fast: torch.Tensor, plain: torch.Tensor, scale: float = 0.0) -> float:
    """|fast - plain| / max(|plain|, scale) (Frobenius norms, in float64); inf when shapes or non-finite entries
    differ."""
    if fast.shape != plain.shape:
        return math.inf
    fast, plain = fast.detach().double(), plain.detach().double()
    finite = torch.isfinite(plain)
    if not torch.equal(finite, torch.isfinite(fast)) or not torch.equal(fast[~finite], plain[~finite]):
        return math.inf  # (nan != nan: a nan in both places is a difference too, and then the model's own problem)
    scale = max(plain[finite].norm().item(), scale)
    return (fast[finite] - plain[finite]).norm().item() / max(scale, 1e-30)


def _projection(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A fixed random cotangent for the `index`-th output (the same for both runs; the global generator untouched)."""
    generator = torch.Generator().manual_seed(0x5EED + index)
    return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.device, torch.float32)


class _Pass:
    """One run of `example`: each swapped module's outputs, call by call, the model's outputs and the gradients."""

    def __init__(self, model: nn.Module, swapped: dict, example: Callable[[nn.Module], Any], autocast):
        self.calls: list[tuple[str, list[torch.Tensor]]] = []
        modules = dict(model.named_modules())
        hooks = [(modules.get(name) or model).register_forward_hook(self._hook(name)) for name in swapped]
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices), _announced_micro_batch(), autocast():
                self.computed_in = _autocast_dtype()
                torch.manual_seed(0)
                outputs = _floats(example(model))
                targets = [(index, t) for index, t in enumerate(outputs) if t.requires_grad]
                if targets:
                    loss = sum((t.float() * _projection(t, index)).sum() for index, t in targets)
                    loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
        self.outputs = [t.detach().clone() for t in outputs]
        self.gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}

    def _hook(self, name: str):
        def record(_module, _args, output):  # cloned now: a no-grad caller may write over its temporaries later
            self.calls.append((name, [t.detach().clone() for t in _floats(output)]))
        return record


@contextlib.contextmanager
def _announced_micro_batch() -> Iterator[None]:
    """Keyed dropout draws the same masks in both runs (micro-batch key 0), as it would in the loop."""
    begin_micro_batch(seed=0, key=0, rank=0, world_size=1)
    try:
        yield
    finally:
        end_micro_batches()


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """The model's state (parameters, buffers) and gradients as they were, whatever the runs inside did."""
    state = {name: value.detach().clone() for name, value in model.state_dict(keep_vars=True).items()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in model.state_dict(keep_vars=True).items():
                value.copy_(state[name])
        for name, p in model.named_parameters():
            p.grad = grads[name]


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast computes in here, None where it is off."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _tolerance(tensor: torch.Tensor, computed_in: torch.dtype | None = None) -> float:
    """The tensor's dtype's, or autocast's where that is coarser: a float32 gradient summed from bfloat16 products
    carries bfloat16's rounding."""
    return max(TOLERANCE.get(tensor.dtype, 1e-4), TOLERANCE.get(computed_in, 0.0))


def _owner(parameter: str, swapped: dict) -> str | None:
    """The swapped module that holds `parameter`, the outermost (an attention, not the Linear inside it that its
    fast path computes without calling)."""
    owners = [name for name in swapped if parameter.startswith(f"{name}.")]
    return min(owners, key=len) if owners else None


def _gradient_scales(plain: _Pass, swapped: dict) -> dict[str, float]:
    """What each parameter's gradient difference is measured against: the norm of the gradients of the swapped module
    that holds it, all together (the others': of all the model's gradients), where that is more than its own. A
    gradient that is zero but for rounding (a key's bias, which softmax cancels: each row of the logits' gradient
    sums to zero; a sum over equal streams) is rounding in both runs, and different rounding where a fast path
    computes what comes before or after it in another order: of the size of the terms summed, not of its own."""
    norms: dict[str | None, float] = {}
    for parameter, gradient in plain.gradients.items():
        for owner in {_owner(parameter, swapped), None}:
            norms[owner] = math.hypot(norms.get(owner, 0.0), gradient.detach().double().norm().item())
    return {parameter: norms[_owner(parameter, swapped)] for parameter in plain.gradients}


def _passes(model: nn.Module, swapped: dict, example, autocast, record: bool) -> tuple[_Pass, _Pass]:
    """`example` run by the model as written, then converted; `record`: each swapped module's outputs too."""
    with _state_kept(model):
        _set_classes(model, swapped, 0)
        try:
            plain = _Pass(model, swapped if record else {}, example, autocast)
            model.zero_grad(set_to_none=True)
        finally:
            _set_classes(model, swapped, 1)
        fast = _Pass(model, swapped if record else {}, example, autocast)
    return plain, fast


def _agree(plain: _Pass, fast: _Pass, swapped: dict) -> bool:
    """The model's outputs and every parameter's gradient within rounding."""
    if len(plain.outputs) != len(fast.outputs) or plain.gradients.keys() != fast.gradients.keys():
        return False
    scales = _gradient_scales(plain, swapped)
    return (all(_difference(f, p) <= _tolerance(p, plain.computed_in)
                for p, f in zip(plain.outputs, fast.outputs, strict=True))
            and all(_difference(fast.gradients[name], p, scales[name]) <= _tolerance(p, plain.computed_in)
                    for name, p in plain.gradients.items()))


def prove(model: nn.Module, swapped: dict, example: Callable[[nn.Module], Any], *,
          autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
          flag: str = "--kernels auto") -> None:
    """Run `example` with the model as written and converted (model holds the fast classes of `swapped`); one line
    (UsageError) at the first difference beyond rounding. The model, its gradients and the random generators are
    left as they were. The outputs and gradients are compared first; only when they differ are both runs made again
    recording every swapped module's outputs, to name the one that differs first."""
    if _agree(*_passes(model, swapped, example, autocast, record=False), swapped):
        return
    plain, fast = _passes(model, swapped, example, autocast, record=True)
    where = f"on {next(model.parameters()).device.type}"
    if plain.computed_in is not None:
        where += f" under {plain.computed_in} autocast"

    def tolerance(tensor: torch.Tensor) -> float:
        return _tolerance(tensor, plain.computed_in)

    def refuse(name: str, what: str, difference: float, tensor: torch.Tensor) -> None:
        plain_class, fast_class = swapped.get(name, (None, None))
        module = (f"{fast_class.__module__}.{fast_class.__qualname__} at {name!r}, the fast path of "
                  f"{plain_class.__module__}.{plain_class.__qualname__}," if fast_class else f"the converted {name!r}")
        size = "differs in shape or non-finite entries" if difference == math.inf else \
            f"differs by {difference:.2g} (relative; rounding stays below {tolerance(tensor):g})"
        raise UsageError(f"{flag}: {module} computes another {what} than the model's own code ({size}, "
                         f"{tensor.dtype} {where}); the model's code was changed after its fast path was written: "
                         "give --kernels plain to train the model as written, or update the fast path to match")

    # Call by call, in the order the written model made them, for each module called as often in both runs: a fast
    # path that computes its parts itself (an attention's products without calling its Linear modules) leaves some
    # of their calls out, and those parts are compared through it
    plain_calls: dict[str, list] = {}
    fast_calls: dict[str, list] = {}
    for calls, runs in ((plain_calls, plain.calls), (fast_calls, fast.calls)):
        for name, outputs in runs:
            calls.setdefault(name, []).append(outputs)
    seen: dict[str, int] = {}
    for name, plain_outputs in plain.calls:
        index = seen[name] = seen.get(name, -1) + 1
        if len(plain_calls[name]) != len(fast_calls.get(name, ())):
            continue
        fast_outputs = fast_calls[name][index]
        if len(fast_outputs) != len(plain_outputs):
            refuse(name, "number of outputs", math.inf, plain_outputs[0] if plain_outputs else torch.empty(0))
        for p, f in zip(plain_outputs, fast_outputs, strict=True):
            difference = _difference(f, p)
            if difference > tolerance(p):
                refuse(name, "output", difference, p)
    if len(plain.outputs) != len(fast.outputs):
        refuse(type(model).__name__, "number of outputs", math.inf, torch.empty(0))
    for p, f in zip(plain.outputs, fast.outputs, strict=True):
        difference = _difference(f, p)
        if difference > tolerance(p):
            refuse(type(model).__name__, "output", difference, p)
    order = list(dict.fromkeys(name for name, _ in plain.calls))  # the swapped modules in the order they first ran
    differing, scales = [], _gradient_scales(plain, swapped)
    for parameter, p in plain.gradients.items():
        f = fast.gradients.get(parameter)
        difference = math.inf if f is None else _difference(f, p, scales[parameter])
        if difference > tolerance(p):
            differing.append((parameter, difference, p))
    if set(fast.gradients) - set(plain.gradients):
        parameter = sorted(set(fast.gradients) - set(plain.gradients))[0]
        differing.append((parameter, math.inf, fast.gradients[parameter]))
    if differing:
        # A wrong backward in one module changes its parameters' gradients and those of every module before it: the
        # culprit is the last (in forward order) swapped module whose own gradients differ.
        owned = [(order.index(_owner(name, swapped)), name, d, t) for name, d, t in differing
                 if _owner(name, swapped) in order]
        if owned:
            _, parameter, difference, tensor = max(owned, key=lambda item: item[0])
            refuse(_owner(parameter, swapped), f"gradient of {parameter}", difference, tensor)
        parameter, difference, tensor = differing[0]
        refuse(type(model).__name__, f"gradient of {parameter}", difference, tensor)


def with_kernels(model: nn.Module, choice: str, example: Callable[[nn.Module], Any], *,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[str]:
    """`auto`: swap in the fast paths (in place) and prove them on `example`; `plain`: nothing. The names of the
    modules swapped (none with plain, or when the model has no fast paths)."""
    if choice not in CHOICES:
        raise UsageError(f"--kernels {choice!r} is invalid; give one of {', '.join(CHOICES)}")
    if choice == "plain":
        return []
    swapped = convert(model)
    if swapped:
        prove(model, swapped, example, autocast=autocast)
    return list(swapped)
