"""Where a process computes, decided once for every recipe and tool.

On a machine with CUDA, a CPU launch config (`use_cpu: true`, e.g. cpu_2proc.yaml for CPU scaling figures on a GPU
node) still asks for the CPU: `accelerate launch` passes it on as ACCELERATE_USE_CPU. The Accelerator honours that
variable, but PartialState, which the toolkit forms first (with its own timeout), does not: asked with cpu=False it
would form an NCCL group on the GPU, and the Accelerator built after it would then refuse to move to the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

TRUE = {"1", "true", "yes", "y", "on"}


def runs_on_cpu(env: Mapping[str, str] | None = None, cuda_available: bool | None = None) -> bool:
    """True when this process must compute on the CPU: no CUDA, or the launch config says use_cpu."""
    env = os.environ if env is None else env
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return not cuda_available or env.get("ACCELERATE_USE_CPU", "").strip().lower() in TRUE


def pin_memory(device: torch.device | str) -> bool:
    """DataLoader pin_memory: only when batches go to a CUDA device (pinning for a CPU run costs and gains nothing,
    also on a GPU machine running a CPU config)."""
    return torch.device(device).type == "cuda"
