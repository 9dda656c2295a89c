"""Float32 linear layers on the CPU by whichever library runs them faster here, for every model that wants them.

torch's float32 `F.linear` / `mm` on the CPU calls MKL's GEMM, which takes its AVX-512 kernels on Intel's CPUs alone:
on the AMD EPYC these recipes were first measured on it runs AVX2 kernels, and at SASRec's and HRM's sizes oneDNN's
inner product (AVX-512 there) is 1.8-2.6x faster, forward and backward (benchmarks/README.md). On
an Intel CPU with AVX-512 MKL's GEMM is the faster: as fast forward, 1.4-2x faster for weight gradients, which it
reads transposed in place where oneDNN copies them (`products_by`). oneDNN's op is torch's own,
`torch.ops.mkldnn._linear_pointwise` (the one inductor's CPU linear fusions call): private, so its presence is
checked once, and every other case takes F.linear: CUDA, other dtypes, autocast (whose bfloat16 products go to
oneDNN already), torch.compile and tracing (inductor chooses there), `torch.backends.mkldnn.enabled = False`, and
products too small to pay oneDNN's fixed cost.

    linear(x, weight, bias=None, min_macs=0)   # F.linear's function, by the faster library where it pays
    eligible(x, weight, min_macs)              # whether it would
    product(x, weight)                         # x @ weight.T (2-D), for hand-written backward passes
    weight_gradient(x, g)                      # g.T @ x, each library's faster way round
    products_by()                              # "onednn" or "mkl": which computes product() on this machine
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from toolkit.run.precision import cpu_vendor


@functools.cache
def available() -> bool:
    """This torch has oneDNN's inner product, and it works (a [2, 3] x [3, 2] product); checked at the first use."""
    try:
        x = torch.ones(2, 3)
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._linear_pointwise(x, x, None, "none", [], "").shape == (2, 2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def eligible(x: torch.Tensor, weight: torch.Tensor, min_macs: int = 0) -> bool:
    """Whether x [..., in] @ weight.T goes to oneDNN: float32 on the CPU, eager, at least `min_macs` multiply-adds."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() // max(x.shape[-1], 1) * weight.numel() >= min_macs
            and torch.backends.mkldnn.enabled and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing() and available())


def mkl_runs_avx512(vendor: str, capability: str, mkl_instructions: str) -> bool:
    """Whether MKL's GEMM takes its AVX-512 kernels: on an Intel CPU (`vendor` GenuineIntel) whose torch runs AVX-512
    (`capability`, torch's), unless MKL_ENABLE_INSTRUCTIONS (`mkl_instructions`) caps it below AVX-512. On AMD's
    CPUs it takes AVX2 kernels whatever they have."""
    capped = bool(mkl_instructions) and not mkl_instructions.upper().startswith(("AVX512", "AVX10"))
    return vendor == "GenuineIntel" and capability == "AVX512" and not capped


@functools.cache
def products_by() -> str:
    """Which library computes `product` and `weight_gradient` here: "mkl" where MKL runs AVX-512 kernels (Intel),
    else "onednn". Decided once from the CPU and the environment alone, never from a timing, so a run's values
    depend on the machine and never on the moment (resume and N processes stay bit-exact)."""
    vendor, capability = cpu_vendor(), torch.backends.cpu.get_cpu_capability()
    return "mkl" if mkl_runs_avx512(vendor, capability, os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")) else "onednn"


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the library `products_by` names; 2-D operands, either may be a transposed view."""
    if products_by() == "mkl":
        return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def weight_gradient(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g.T @ x for 2-D x [rows, in] and g [rows, out], each machine's faster way round (benchmarks/products.py
    times them):
    - MKL's products (`products_by` "mkl": Intel, AVX-512): mm(g.T, x), which reads g transposed in place; the one
      way round whose values do not depend on g's layout there (x.T @ g differs in the last bits at 1 thread).
    - oneDNN's, with AVX-512 (AMD): oneDNN, 1.4-2.2x faster than MKL's AVX2 mm even with the contiguous copy it makes
      of its first operand: the narrower side first (x.T @ g, transposed into the weight's layout, where x has fewer
      columns than g), so that the copy is the narrower one.
    - oneDNN's, AVX2 alone: MKL's mm (oneDNN ran 0.5-1.0x of it at HRM's sizes), the same way round, 13% faster at
      SASRec's [25600, 150] by [25600, 50]; except g at least 4x wider than x (HRM's SwiGLU gate_up): oneDNN's g.T @ x,
      13% faster than mm where g.T is at hand contiguous (the transposed SwiGLU holds it).
    The way round depends on the shapes alone, never on g's layout, so a gradient has the same values whichever
    layout its caller holds (tested)."""
    if products_by() == "mkl":
        return torch.mm(g.t(), x)
    narrower_x = x.shape[1] < g.shape[1]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return product(x.t(), g.t()).t().contiguous() if narrower_x else product(g.t(), x.t())
    if g.shape[1] >= 4 * x.shape[1]:
        return product(g.t(), x.t())
    return torch.mm(x.t(), g).t().contiguous() if narrower_x else torch.mm(g.t(), x)


class OneDNNLinear(torch.autograd.Function):
    """x W^T + b and its gradients (g W; g^T x by weight_gradient; the bias's a sum), each one `product` (oneDNN's, or
    MKL's where `products_by` says): the same function as F.linear up to float rounding (the order of the sums in
    each dot product)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = product(grad_rows, weight.t()).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient(rows, grad_rows)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_macs: int = 0) -> torch.Tensor:
    """F.linear(x, weight, bias), by `product` where `eligible`: with autograd's graph through OneDNNLinear when a
    gradient is wanted, else the bare product."""
    if not eligible(x, weight, min_macs):
        return F.linear(x, weight, bias)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if wants_grad:
        return OneDNNLinear.apply(x, weight, bias)
    return product(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
