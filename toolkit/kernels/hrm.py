"""HRM's CPU kernels: toolkit/models/hrm.py's Linear, Attention, SwiGLU and RMSNorm, faster in float32 on the CPU.

Swapped in by toolkit.kernels when a run builds the model (`--kernels auto`), and proven equal to the model file's
code at every start; each takes its kernel where it applies and the model's own code (`super()`) everywhere else.

In float32 on the CPU (eager, products of >= 1M multiply-adds, `by_onednn`) the linear layers are
toolkit.kernels.onednn's products, forward and backward: oneDNN's inner product, or MKL's GEMM where MKL runs
AVX-512 kernels (Intel; on an AMD EPYC its kernels are AVX2's and oneDNN's AVX-512 ones ~2.2x faster). Attention and
SwiGLU with gradient are one autograd Function each (`OneDNNAttention`, `OneDNNSwiGLU`, the latter transposed) whose
backward writes the gradients over the forward's own temporaries: the same operations as autograd through the
model's parts, fewer fresh tensors (each fresh megabyte a step is ~256 page faults on glibc's trimmed heap).
RMSNorm's gradient is written out (`RMSNormFunction`, on every device). Elsewhere (CUDA, float64, bfloat16
autocast, --compile) the model's own code runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.kernels import onednn, replaces
from toolkit.models import hrm
from toolkit.models.hrm import rotate_in_place, swap_halves

ONEDNN_MIN_MACS = 1 << 20  # below ~1M multiply-adds oneDNN's fixed cost (~10 us a call) outweighs its speed


def rows_to_exercise(hidden: int) -> int:
    """Rows [n, hidden] from which every product of a block of this width passes ONEDNN_MIN_MACS (the smallest is the
    attention's output projection, hidden x hidden): an example this large takes every CPU kernel a block takes."""
    return -(-ONEDNN_MIN_MACS // (hidden * hidden))


def by_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether HRM's products of x [rows, in] by weight go to toolkit.kernels.onednn (`eligible`, from ~1M
    multiply-adds)."""
    return onednn.eligible(x, weight, ONEDNN_MIN_MACS)


@replaces(hrm.Linear)
class Linear(hrm.Linear):
    """Products by toolkit.kernels.onednn (`OneDNNLinear`, forward and backward) where `by_onednn`; else F.linear."""

    def outputs(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight = self.weight if (start, stop) == (0, self.weight.shape[0]) else self.weight[start:stop]
        return onednn.linear(flat, weight, min_macs=ONEDNN_MIN_MACS).view(*x.shape[:-1], -1)


class RMSNormFunction(torch.autograd.Function):
    """y = x r, r = rsqrt(mean(x^2) + eps), the forward's operations as before, with the gradient written out:
    dx = r (g - y mean(g y)) in 5 operations (autograd's, through pow, mean, add and rsqrt: 11)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        squares = x.square()
        r = squares.mean(-1, keepdim=True).add_(eps).rsqrt_()
        y = torch.mul(x, r, out=squares)  # over the squares, read by now: one fresh tensor, not two
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, r = ctx.saved_tensors
        # (g - y mean(g y)) r, each step written over g y, a temporary of its own (one fresh tensor, not four)
        work = g * y
        mean = work.mean(-1, keepdim=True)
        return torch.sub(g, torch.mul(y, mean, out=work), out=work).mul_(r), None


@replaces(hrm.RMSNorm)
class RMSNorm(hrm.RMSNorm):
    """With gradient: RMSNormFunction, the gradient written out."""

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x, inplace)
        dtype = x.dtype
        return RMSNormFunction.apply(x.to(hrm.at_least_float32(dtype)), self.eps).to(dtype)


def spend(ctx, what: str) -> None:
    """The backward of OneDNNAttention and OneDNNSwiGLU writes its gradients over the forward's saved tensors: a
    second backward through the same graph (retain_graph) would read gradients as activations, so it is refused."""
    if getattr(ctx, "spent", False):
        raise RuntimeError(f"HRM's {what} backward runs once per forward (it writes over its saved tensors): a second "
                           "backward through the same graph (retain_graph) is not supported")
    ctx.spent = True


class OneDNNAttention(torch.autograd.Function):
    """Attention.forward with gradient, its products by toolkit.kernels.onednn (oneDNN, or MKL), SDPA's CPU flash
    kernels called as F.scaled_dot_product_attention calls them, and the backward written over the forward's own
    temporaries: the qkv product takes its own gradient (v's, then q's and k's through the rotation), where autograd
    made five new tensors for the rotation's backward and a sixth for the split's cat. The same operations on the same
    operands as autograd through Attention's parts, so the same values bit for bit. Its saved tensors are spent: one
    backward per forward. x is 2-D [batch x length, hidden]; cos, signed_sin and swapped_sin are Rotary's tables
    (None: no rotation)."""

    @staticmethod
    def forward(ctx, x, w_qkv, w_out, cos, signed_sin, swapped_sin, length: int, heads: int):
        rows, hidden = x.shape
        qkv = onednn.product(x, w_qkv).view(rows // length, length, 3, heads, hidden // heads)
        if cos is not None:  # Rotary's sums, on q's and k's heads side by side
            # Over q's and k's place in qkv: the backward reads them, rotated, and then writes their gradient there
            rotate_in_place(qkv.view(rows // length, length, -1)[..., :2 * hidden], cos, signed_sin, hidden // heads)
        q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
        v = qkv[:, :, 2].transpose(1, 2)
        attended, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        ctx.save_for_backward(x, w_qkv, w_out, cos, swapped_sin, qkv, q, k, attended, logsumexp)
        return onednn.product(attended.transpose(1, 2).reshape(rows, hidden), w_out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        spend(ctx, "attention")
        x, w_qkv, w_out, cos, swapped_sin, qkv, q, k, attended, logsumexp = ctx.saved_tensors
        rows, hidden = x.shape
        flat = attended.transpose(1, 2).reshape(rows, hidden)
        grad_w_out = onednn.weight_gradient(flat, g) if ctx.needs_input_grad[2] else None
        grad_attended = onednn.product(g, w_out.t()).view(attended.transpose(1, 2).shape).transpose(1, 2)
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_attended, q, k, qkv[:, :, 2].transpose(1, 2), attended, logsumexp, 0.0, False)
        qkv[:, :, 2].copy_(grad_v.transpose(1, 2))  # qkv now takes its gradient: v's, q's and k's
        qkv[:, :, 0].copy_(grad_q.transpose(1, 2))
        qkv[:, :, 1].copy_(grad_k.transpose(1, 2))
        if cos is not None:  # (qk cos)'s backward, plus (swapped qk sin)'s, swapped back: g cos + swap(g sin)
            batch, length, _, _, head_dim = qkv.shape
            grad_qk = qkv.view(batch, length, -1)[..., :2 * hidden]
            # swap(g sin) as swap(g) swap(sin): each element the same product, where it lands
            swapped = swap_halves(grad_qk, head_dim).mul_(swapped_sin)
            grad_qk.mul_(cos).add_(swapped)
        grad = qkv.view(rows, -1)
        grad_x = onednn.product(grad, w_qkv.t()) if ctx.needs_input_grad[0] else None
        grad_w_qkv = onednn.weight_gradient(x, grad) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w_qkv, grad_w_out, None, None, None, None, None


@replaces(hrm.Attention)
class Attention(hrm.Attention):
    """With gradient, in float32 on the CPU at `by_onednn` sizes: OneDNNAttention; else the model's own code."""

    def forward(self, x: torch.Tensor, rotary: hrm.Rotary | None, first_only: bool = False) -> torch.Tensor:
        batch, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        if (torch.is_grad_enabled() and not first_only and by_onednn(flat, self.qkv.weight)
                and (rotary is None or rotary.cos.dtype == torch.float32)):
            tables = (rotary.cos, rotary.signed_sin, rotary.swapped_sin) if rotary is not None else (None,) * 3
            out = OneDNNAttention.apply(flat, self.qkv.weight, self.out.weight, *tables, length, self.heads)
            return out.view(batch, length, hidden)
        return super().forward(x, rotary, first_only)


class OneDNNSwiGLU(torch.autograd.Function):
    """down(silu(gate) up) with [gate, up] = x @ gate_up.T, its products by toolkit.kernels.onednn (oneDNN, or MKL),
    computed transposed: gate_up.T = gate_up @ x.T, [2 x width, rows], so that gate and up are contiguous blocks, not
    the strided halves of each row (silu and its backward ran ~2x slower over those: 1.6 against 0.64 ms at cpu-small,
    AVX2 caps). The backward is written over the forward's own temporaries: the gate_up product takes its own
    gradient (up's, then gate's, through silu's backward of the product's place), where autograd made four new tensors
    of that size (two products, silu's backward and chunk's cat). Each product's elements are the same dot products,
    transposed: the same values as autograd through the parts, bit for bit (tested). Its saved tensors are spent: one
    backward per forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        gate_up_t = onednn.product(w_gate_up, x)
        gate_t, up_t = gate_up_t.chunk(2, dim=0)
        activated_t = F.silu(gate_t)
        product_t = activated_t * up_t
        ctx.save_for_backward(x, w_gate_up, w_down, gate_up_t, activated_t, product_t)
        return onednn.product(w_down, product_t.t()).t().contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        spend(ctx, "SwiGLU")
        x, w_gate_up, w_down, gate_up_t, activated_t, product_t = ctx.saved_tensors
        gate_t, up_t = gate_up_t.chunk(2, dim=0)
        grad_w_down = onednn.weight_gradient(product_t.t(), g) if ctx.needs_input_grad[2] else None
        grad_product_t = onednn.product(w_down.t(), g)
        # product, read for the last time above, takes grad * up; up's place takes grad * silu(gate) (MulBackward's
        # two products); gate's place takes silu's backward: gate_up holds its gradient, [gate's, up's]
        grad_activated_t = torch.mul(grad_product_t, up_t, out=product_t)
        torch.mul(activated_t, grad_product_t, out=up_t)
        torch.ops.aten.silu_backward.grad_input(grad_activated_t, gate_t, grad_input=gate_t)
        grad_x = onednn.product(w_gate_up.t(), gate_up_t.t()).t().contiguous() if ctx.needs_input_grad[0] else None
        grad_w_gate_up = onednn.weight_gradient(x, gate_up_t.t()) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w_gate_up, grad_w_down


@replaces(hrm.SwiGLU)
class SwiGLU(hrm.SwiGLU):
    """In float32 on the CPU at `by_onednn` sizes: OneDNNSwiGLU with gradient, two products without; else the
    model's own code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if by_onednn(flat, self.gate_up.weight):
            if torch.is_grad_enabled():
                return OneDNNSwiGLU.apply(flat, self.gate_up.weight, self.down.weight).view(*x.shape[:-1], -1)
            # gate and up as two products (each the same values as that half of the one product, bit for bit): silu
            # and the product are then written over gate, a contiguous temporary, where silu's result was a fresh
            # tensor in memory the cache no longer held (~1 ms a call at cpu-small)
            width, weight = self.down.weight.shape[1], self.gate_up.weight
            gate = F.silu(onednn.product(flat, weight[:width]), inplace=True)
            product = gate.mul_(onednn.product(flat, weight[width:]))
            return onednn.product(product, self.down.weight).view(*x.shape[:-1], -1)
        return super().forward(x)
