"""Fast paths kept apart from the models they speed up: swapped in by one step when a run builds its model, and
proven equal to the model's own code at every start.

A model file is the plain PyTorch a researcher reads and edits. Its fast paths (oneDNN/MKL products with
written-out backwards, chunked attention with its dropout, a fused sequence kernel) live in a kernels module that
the model file names in one line, `FAST_PATHS = "toolkit.kernels.hrm"`. There each fast path is a subclass of the
plain module it replaces, registered with `replaces`, whose forward takes the fast path where it applies and the
model's own code (`super().forward`) everywhere else (a class whose path never applies to a module, as DCRNN's fused
kernel on a CPU by default, says so with `applies(module)` and is not swapped in):

    @replaces(hrm.Attention)
    class Attention(hrm.Attention):
        def forward(self, x, rotary, first_only=False):
            if <the CPU kernel applies>:
                return OneDNNAttention.apply(...)
            return super().forward(x, rotary, first_only)

`with_kernels(model, "auto", example)` (a recipe calls it through `Run.with_kernels`, before its loop starts)
swaps the class of each such module in place, which keeps its parameters, buffers and state_dict (a checkpoint
cannot tell), then proves the swap: the model as written runs `example` (one batch of a few samples at the model's
own sizes, on the run's device and under its autocast) until each swapped class has been called once, and each of
those calls is made again by the plain class and by the fast one, without gradient and with it (a fixed random
cotangent). The outputs, the module's parameters' gradients and its inputs' gradients must agree within rounding;
the first that does not is one line naming the module, and the run stops with exit status 2 before its directory is
made. The rest of the example is not run: the proof costs a few module calls, not passes of the whole model
(benchmarks/kernel_proof.py). `"plain"` converts nothing: the code in the model file, exactly.

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
        # A fast class may say where it applies (`applies(module)`, e.g. DCRNN's fused kernel: on CUDA or when asked
        # for): elsewhere the module stays as written, and there is nothing to prove
        if fast is not None and getattr(fast, "applies", lambda _: True)(module):
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
    """|fast - plain| / max(|plain|, scale) (Frobenius norms, summed in float64); inf when shapes or non-finite
    entries differ."""
    if fast.shape != plain.shape:
        return math.inf
    fast, plain = fast.detach(), plain.detach()
    finite = torch.isfinite(plain)
    if not bool(finite.all()):  # the rare case: compare the non-finite entries, then the rest
        if not torch.equal(finite, torch.isfinite(fast)) or not torch.equal(fast[~finite], plain[~finite]):
            return math.inf  # (nan != nan: a nan in both places is a difference too, the model's own problem)
        fast, plain = fast[finite], plain[finite]
    elif not bool(torch.isfinite(fast).all()):
        return math.inf
    norm = max(torch.linalg.vector_norm(plain, dtype=torch.float64).item(), scale)
    return torch.linalg.vector_norm(fast - plain, dtype=torch.float64).item() / max(norm, 1e-30)


def _projection(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A fixed random cotangent for the `index`-th output (the same for both runs; the global generator untouched)."""
    generator = torch.Generator().manual_seed(0x5EED + index)
    return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.device, torch.float32)


class _Enough(Exception):
    """Raised by the recording hook once every swapped class has been called: the rest of the example is not run."""


def _first_calls(model: nn.Module, swapped: dict, example: Callable[[nn.Module], Any], autocast) -> list[tuple]:
    """The model as written runs `example` until each swapped class has been called once: (name, module, args,
    kwargs) of each class's first call, its tensors cloned (a no-grad caller may write over them later)."""
    wanted = {classes[0] for classes in swapped.values()}
    calls, modules = [], dict(model.named_modules())

    def recorder(name: str):
        def record(module, args, kwargs):
            if type(module) in wanted:
                wanted.discard(type(module))
                calls.append((name, module, *_detached((args, kwargs))))
                if not wanted:
                    raise _Enough
        return record

    hooks = [(modules.get(name) or model).register_forward_pre_hook(recorder(name), with_kwargs=True)
             for name in swapped]
    try:
        with _isolated(model, autocast), torch.no_grad():
            example(model)
    except _Enough:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _detached(value: Any) -> Any:
    """value with every tensor detached and cloned (tuples, lists and dicts rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(item) for item in value)
    return value


def _with_gradients(value: Any, leaves: list) -> Any:
    """A fresh copy of value whose floating-point tensors are leaves that take a gradient (collected in `leaves`)."""
    if isinstance(value, torch.Tensor):
        copy = value.clone()
        if copy.is_floating_point():
            copy.requires_grad_(True)
            leaves.append(copy)
        return copy
    if isinstance(value, dict):
        return {key: _with_gradients(item, leaves) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_with_gradients(item, leaves) for item in value)
    return value


@contextlib.contextmanager
def _isolated(model: nn.Module, autocast) -> Iterator[None]:
    """A run of the model's code that leaves the random generators as they were, with keyed dropout's masks the
    same in every run (micro-batch key 0, as in the loop), under the run's autocast."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), _announced_micro_batch(), autocast():
        torch.manual_seed(0)
        yield


class _Call:
    """One swapped module called on its recorded inputs as one class (plain or fast): its outputs, and with
    `gradient` the gradients of its parameters and of its floating-point inputs under a fixed random cotangent."""

    def __init__(self, model, module: nn.Module, cls: type, args, kwargs, gradient: bool, autocast):
        module.__class__ = cls
        leaves: list[torch.Tensor] = []
        args, kwargs = (_with_gradients((args, kwargs), leaves) if gradient else _detached((args, kwargs)))
        module.zero_grad(set_to_none=True)
        with _isolated(model, autocast), torch.set_grad_enabled(gradient):
            self.computed_in = _autocast_dtype()
            outputs = _floats(module(*args, **kwargs))
            targets = [(index, t) for index, t in enumerate(outputs) if t.requires_grad]
            if gradient and targets:
                sum((t.float() * _projection(t, index)).sum() for index, t in targets).backward()
        self.outputs = [t.detach().clone() for t in outputs]
        self.gradients = {f"parameter {name}": p.grad.detach().clone() for name, p in module.named_parameters()
                          if p.grad is not None}
        self.gradients.update({f"input {index}": leaf.grad.detach().clone() for index, leaf in enumerate(leaves)
                               if leaf.grad is not None})
        module.zero_grad(set_to_none=True)


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


def prove(model: nn.Module, swapped: dict, example: Callable[[nn.Module], Any], *,
          autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
          flag: str = "--kernels auto") -> None:
    """Prove each swapped class on its first call in `example` (model holds the fast classes of `swapped`): the
    model as written runs the example until every swapped class has been called once, and each such call is made
    again by the plain class and by the fast one, without gradient and with (a fixed random cotangent): outputs, the
    module's parameters' gradients and its inputs' gradients must agree within rounding. One line (UsageError) at
    the first that does not. The model, its gradients and the random generators are left as they were."""
    with _state_kept(model):
        _set_classes(model, swapped, 0)
        try:
            calls = _first_calls(model, swapped, example, autocast)
            for name, module, args, kwargs in calls:
                plain_class, fast_class = swapped[name]
                for gradient in (False, True):
                    plain = _Call(model, module, plain_class, args, kwargs, gradient, autocast)
                    fast = _Call(model, module, fast_class, args, kwargs, gradient, autocast)
                    module.__class__ = plain_class
                    _compare(name, plain_class, fast_class, plain, fast, gradient, flag)
        finally:
            _set_classes(model, swapped, 1)


def _compare(name: str, plain_class: type, fast_class: type, plain: _Call, fast: _Call, gradient: bool,
             flag: str) -> None:
    """One line (UsageError) where the fast class's call differs from the plain one's beyond rounding."""
    def refuse(what: str, difference: float, tensor: torch.Tensor | None) -> None:
        dtype = tensor.dtype if tensor is not None else None
        size = "differs in shape, number or non-finite entries" if difference == math.inf else \
            f"differs by {difference:.2g} (relative; rounding stays below {_tolerance(tensor, plain.computed_in):g})"
        device = "" if tensor is None else f", {dtype} on {tensor.device.type}"
        under = f" under {plain.computed_in} autocast" if plain.computed_in is not None else ""
        raise UsageError(f"{flag}: {fast_class.__module__}.{fast_class.__qualname__} at {name!r}, the fast path of "
                         f"{plain_class.__module__}.{plain_class.__qualname__}, computes another {what} than the "
                         f"model's own code {'with' if gradient else 'without'} gradient ({size}{device}{under}); "
                         "the model's code was changed after its fast path was written: give --kernels plain to "
                         "train the model as written, or update the fast path to match")

    if len(plain.outputs) != len(fast.outputs):
        refuse("number of outputs", math.inf, None)
    for p, f in zip(plain.outputs, fast.outputs, strict=True):
        difference = _difference(f, p)
        if difference > _tolerance(p, plain.computed_in):
            refuse("output", difference, p)
    if plain.gradients.keys() != fast.gradients.keys():
        refuse("set of gradients", math.inf, None)
    # A gradient that is zero but for rounding (a key's bias, which softmax cancels) is rounding in both runs, and
    # other rounding where the fast path sums in another order: measured against all the module's gradients
    scale = math.sqrt(sum(g.detach().double().norm().item() ** 2 for key, g in plain.gradients.items()
                          if key.startswith("parameter")))
    for key, p in plain.gradients.items():
        difference = _difference(fast.gradients[key], p, scale if key.startswith("parameter") else 0.0)
        if difference > _tolerance(p, plain.computed_in):
            refuse(f"gradient of its {key}", difference, p)


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
