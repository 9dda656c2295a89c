"""The optimizer a recipe's --optimizer flag names, made in one place (and its parameter count said in one line).

    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                               weight_decay=cfg.weight_decay)
    run.print(model_line("SASRec (post-LN)", model))      # model: SASRec (post-LN), 12,345 parameters

Betas and eps apply to the Adam family; SGD takes the learning rate and the weight decay only. A family adds its own
with register_optimizer (HRM's adam-atan2, in toolkit.models.hrm), so this module knows no family."""

from __future__ import annotations

from collections.abc import Callable

import torch

from toolkit.errors import UsageError

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {}  # --optimizer NAME -> its factory


def register_optimizer(name: str, factory: Callable[..., torch.optim.Optimizer]) -> None:
    """A family's own optimizer for --optimizer NAME, registered where the family defines it (HRM's adam-atan2 in
    toolkit.models.hrm): factory(parameters, *, lr, weight_decay, betas, eps) -> an optimizer."""
    OPTIMIZERS[name] = factory


def make_optimizer(choice: str, parameters, *, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.Optimizer:
    factory = OPTIMIZERS.get(choice)
    if factory is None:
        raise UsageError(f"--optimizer {choice} is not known; give one of {', '.join(OPTIMIZERS)}")
    return factory(list(parameters), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


# fused: the whole step is one kernel (CPU and CUDA), with no read of the step count on the host; torch's default on
# CPU, a for-loop, launches 6 ops per parameter and reads each parameter's step count (a sync on a GPU). Its
# arithmetic differs from the for-loop's by an ulp, and is the same on every rank and every resume.
register_optimizer("adam", lambda parameters, *, lr, weight_decay, betas, eps: torch.optim.Adam(
    parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
register_optimizer("adamw", lambda parameters, *, lr, weight_decay, betas, eps: torch.optim.AdamW(
    parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
register_optimizer("sgd", lambda parameters, *, lr, weight_decay, betas, eps: torch.optim.SGD(
    parameters, lr=lr, weight_decay=weight_decay))


def step_optimizer(accelerator, model, max_grad_norm: float, optimizer, scheduler=None) -> None:
    """Clip the gradients to max_grad_norm (0: off) when they sync (the last micro-batch of an accumulation window),
    step the optimizer (or each of a list, in turn) and the scheduler (Accelerate's wrappers skip both inside a
    window), zero the gradients."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    if max_grad_norm and accelerator.sync_gradients:
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    for each in optimizers:
        each.step()
    if scheduler is not None:
        scheduler.step()
    for each in optimizers:
        each.zero_grad(set_to_none=True)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_line(description: str, model: torch.nn.Module) -> str:
    """`model: <description>, N parameters`, the line each recipe prints once its model is made."""
    return f"model: {description}, {parameter_count(model):,} parameters"
