"""HRM, the Hierarchical Reasoning Model (Wang et al. 2025, arXiv 2506.21734), in plain torch.

Two recurrent transformer modules, L (fast) and H (slow), each a stack of post-norm blocks (RMSNorm without a
scale, non-causal scaled_dot_product_attention with RoPE or learned positions, SwiGLU, no biases, truncated-normal
init). One segment runs H_cycles x L_cycles updates, z_L = L(z_L, z_H + x) and z_H = H(z_H, z_L) every L_cycles
L updates, all without gradient except the last L and H update (the one-step gradient); the state is detached
between segments (deep supervision). Adaptive computation time (ACT): a Q head on the first position gives
(q_halt, q_continue); in training a sequence halts when q_halt > q_continue or at halt_max_steps, with exploration
forcing a random minimum of 2..halt_max_steps segments; in evaluation every sequence runs halt_max_steps.

The carry holds each row's state, segment count, halted flag and data. Halted rows take the new batch's row at
the same position (their state restarts from the initial state); running rows keep their data and the new batch's
row there is skipped, as in the reference implementation.

Launches and --compile: the model's call is one graph (tests/test_hrm_compile.py). What needs the host happens in
HRM.__call__, before the compiled forward: the exploration key's integers (the step among them) are hashed there,
so no step number reaches the graph (it recompiled every step), and the puzzle-embedding rows' leaf tensor is made
there once (made inside the forward, it broke the graph). The model computes what it did, operation for operation
(tests/test_hrm_reference.py), in fewer launches: q and k rotated together, linear layers on 2-D views, the
embedding reused by the target-Q segment, the exploration draws compared as integers; so do the losses (the metrics
summed as one tensor) and AdamATan2 (atan2 in one launch).

CPU time (benchmarks/README.md, references): the target-Q segment computes H's last block at the first position
only (all q reads; q's product too); without gradient a block writes its sums, norms, rotation and products over its
own temporaries (the same values, fewer fresh tensors: a fresh result's memory is rarely in the cache, and writing it
reads it in first). The CPU kernels (oneDNN/MKL products, attention and SwiGLU as one autograd Function each with
their backward written out, RMSNorm's gradient) are toolkit/kernels/hrm.py's, swapped in when a run builds the model
and proven equal to this file's code at every start (`--kernels auto`); `--kernels plain` trains this file as it is.

Also here: stablemax cross-entropy (float64), the Q-learning losses (`act_losses`), AdamATan2 and the sparse
puzzle-embedding table with its SignSGD update (`PuzzleEmbedding`, `SparseSignSGD`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.run.optim import register_optimizer
from toolkit.run.randomness import MASK32, keyed_hash_int, mix32

FAST_PATHS = "toolkit.kernels.hrm"  # the CPU kernels of Linear, Attention, SwiGLU and RMSNorm (toolkit.kernels)
IGNORE_LABEL = -100


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


def trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Normal truncated at +-2 standard deviations, rescaled so the result's std is `std` (as JAX's initialisers;
    torch's trunc_normal_ with std s gives about 0.88 s)."""
    scaled = std / 0.87962566103423978
    with torch.no_grad():
        return nn.init.trunc_normal_(tensor, mean=0.0, std=scaled, a=-2 * scaled, b=2 * scaled)


class Linear(nn.Module):
    """A bias-free linear layer initialised with a truncated normal of std 1/sqrt(fan_in)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(out_features, in_features), 1.0 / math.sqrt(in_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outputs(x, 0, self.weight.shape[0])

    def outputs(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Outputs start..stop alone, as their own product (the same values as there in the whole one)."""
        # On the 2-D view: the same mm a 3-D input folds into, without matmul's reshape of its result (an op each)
        flat = x.reshape(-1, x.shape[-1])
        weight = self.weight if (start, stop) == (0, self.weight.shape[0]) else self.weight[start:stop]
        return F.linear(flat, weight).view(*x.shape[:-1], -1)


_AT_LEAST_FLOAT32 = {dtype: torch.promote_types(dtype, torch.float32)
                     for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precisions and float32, float64 for float64 (the reference's float32 casts, which a float64
    check must not round). Looked up: torch.promote_types is an op dispatched at every call."""
    return _AT_LEAST_FLOAT32.get(dtype) or torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm without a learned scale, x rsqrt(mean(x^2) + eps), computed in at least float32 (no parameters: one
    instance serves a whole block)."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """`inplace` (no gradient, x a temporary of the caller's): the result is written over x when x is already in
        that precision (the same values)."""
        dtype = x.dtype
        x = x.to(at_least_float32(dtype))
        squares = x.square()
        if torch.is_grad_enabled():
            return (x * squares.mean(-1, keepdim=True).add(self.eps).rsqrt()).to(dtype)
        r = squares.mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x.mul_(r) if inplace else torch.mul(x, r, out=squares)).to(dtype)


def _plus(temporary: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """temporary + other, written over temporary (a result of the caller's, unused elsewhere) when there is no
    gradient to keep and the sum has its dtype."""
    if torch.is_grad_enabled() or temporary.dtype != other.dtype:
        return temporary + other
    return temporary.add_(other)


def swap_halves(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's two halves swapped in x [..., heads x head_dim] (torch.roll by head_dim / 2 within every head, as
    one cat: a roll on the CPU is a cat of two slices too)."""
    halves = x.unflatten(-1, (-1, 2, head_dim // 2))
    return torch.cat([halves[..., 1:, :], halves[..., :1, :]], dim=-2).flatten(-3)


def rotate_in_place(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotary's sum without gradient, qk cos + swap_halves(qk) signed_sin, written over qk (a temporary of the
    caller's, in the tables' dtype; strided rows, as in qkv, are fine): one fresh tensor (the swapped halves) where a
    new result would be a second, written to memory the cache no longer holds."""
    swapped = swap_halves(qk, head_dim).mul_(signed_sin)
    return qk.mul_(cos).add_(swapped)


class Rotary(nn.Module):
    """x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1) in each head. Computed as x cos + swap_halves(x)
    (-sin1, sin2): the same products (a negation is exact, on either factor), one cat in place of a negation, two
    slices and a cat.

    It rotates q's and k's heads side by side, as they lie in a row of the qkv product ([..., L, 2 x heads x
    head_dim]), with tables repeated to that width ([L, 2 x heads x head_dim]): every elementwise pass runs along
    whole rows. With [L, head_dim] tables broadcast over the heads, each pass ran head_dim (16) elements at a time: a
    rotation at cpu-small took 2.8 ms on the CPU where this takes 0.45."""

    def __init__(self, head_dim: int, positions: int, heads: int, base: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        sin, half = angles.sin(), head_dim // 2
        signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("cos", angles.cos().repeat(1, 2 * heads), persistent=False)
        self.register_buffer("signed_sin", signed_sin.repeat(1, 2 * heads), persistent=False)
        # signed_sin with each head's halves swapped, for the rotation's backward: swap(g sin) = swap(g) swap(sin)
        self.register_buffer("swapped_sin", swap_halves(self.signed_sin, head_dim), persistent=False)

    def tables(self, qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for qk [..., L', width]: positions 0..L'-1, and as many heads as qk's width holds (the
        tables repeat per head, so q's or k's heads alone take the first half)."""
        length, width = qk.shape[-2:]
        return self.cos[:length, :width], self.signed_sin[:length, :width]

    def forward(self, qk: torch.Tensor) -> torch.Tensor:  # qk [..., L, 2 x heads x head_dim]; rows may be strided
        # In the tables' precision (float32; bfloat16 inputs are rotated in float32 and cast back, as the reference)
        dtype = qk.dtype
        if not torch.is_grad_enabled():  # the same sums, over a copy of qk's own
            return self.rotate_temporary(qk.to(self.cos.dtype, copy=True)).to(dtype)
        qk = qk.to(self.cos.dtype)
        cos, signed_sin = self.tables(qk)
        return (qk * cos + swap_halves(qk, self.head_dim) * signed_sin).to(dtype)

    def rotate_temporary(self, qk: torch.Tensor) -> torch.Tensor:
        """forward(qk), written over qk (a temporary of the caller's) where it can: without gradient, in the tables'
        dtype."""
        if torch.is_grad_enabled() or qk.dtype != self.cos.dtype:
            return self(qk)
        return rotate_in_place(qk, *self.tables(qk), self.head_dim)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = Linear(hidden, 3 * hidden)
        self.out = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, first_only: bool = False) -> torch.Tensor:
        """first_only: the output at the first position alone ([B, 1, hidden]; its query against every key)."""
        batch, length, hidden = x.shape
        heads = (self.heads, hidden // self.heads)
        if first_only:  # q's product at the first position alone: a third of the qkv product less
            q = self.qkv.outputs(x[:, :1], 0, hidden)
            k, v = self.qkv.outputs(x, hidden, 3 * hidden).split(hidden, dim=-1)
            if rotary is not None:
                q, k = rotary.rotate_temporary(q), rotary.rotate_temporary(k)
            q, k, v = (part.unflatten(-1, heads).transpose(1, 2) for part in (q, k, v))
        else:
            qkv = self.qkv(x)
            # Split where q, k and v lie side by side: their gradients are then joined into qkv's layout directly
            # (split across a permuted dim, qkv's gradient was copied once more to be contiguous). q and k are
            # rotated together, as they lie in qkv's rows: the same elementwise operations, half the launches.
            if rotary is not None:
                qk, v = qkv.split([2 * hidden, hidden], dim=-1)
                q, k = rotary.rotate_temporary(qk).unflatten(-1, (2, *heads)).unbind(2)
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.unflatten(-1, heads).transpose(1, 2)
            else:
                q, k, v = (part.transpose(1, 2) for part in qkv.unflatten(-1, (3, *heads)).unbind(2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.out(attended.transpose(1, 2).reshape(batch, q.shape[2], hidden))


def swiglu_width(hidden: int, expansion: float) -> int:
    """2/3 of expansion x hidden, rounded up to a multiple of 256 (the reference's choice)."""
    width = round(expansion * hidden * 2 / 3)
    return (width + 255) // 256 * 256


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, expansion: float):
        super().__init__()
        width = swiglu_width(hidden, expansion)
        self.gate_up = Linear(hidden, 2 * width)
        self.down = Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if torch.is_grad_enabled():
            return self.down(F.silu(gate) * up)
        return self.down(F.silu(gate).mul_(up))  # the same values, the product written over silu's


class Block(nn.Module):
    """Post-norm: x = norm(x + attention(x)); x = norm(x + mlp(x)). Without gradient, each sum and norm is written
    over the block's own temporaries (the same values, fewer fresh allocations)."""

    def __init__(self, hidden: int, heads: int, expansion: float):
        super().__init__()
        self.attention = Attention(hidden, heads)
        self.mlp = SwiGLU(hidden, expansion)
        self.norm = RMSNorm()

    def forward(self, x: torch.Tensor, rotary: Rotary | None, first_only: bool = False) -> torch.Tensor:
        """first_only: the first position's output alone ([B, 1, hidden]), what the target-Q segment reads."""
        attended = self.attention(x, rotary, first_only)
        x = self.norm(_plus(attended, x[:, :1] if first_only else x), inplace=True)
        return self.norm(_plus(self.mlp(x), x), inplace=True)


class ReasoningModule(nn.Module):
    """A stack of blocks applied to the state plus an injected input."""

    def __init__(self, layers: int, hidden: int, heads: int, expansion: float):
        super().__init__()
        self.blocks = nn.ModuleList([Block(hidden, heads, expansion) for _ in range(layers)])

    def forward(self, state: torch.Tensor, injection: torch.Tensor, rotary: Rotary | None,
                first_only: bool = False, injection_is_temporary: bool = False) -> torch.Tensor:
        """first_only: the last block computes the first position's output alone ([B, 1, hidden]).
        injection_is_temporary: injection is the caller's own temporary, and without gradient the sum is written over
        it (`_plus`)."""
        state = _plus(injection, state) if injection_is_temporary else state + injection
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            state = block(state, rotary, first_only and index == last)
        return state


# ----------------------------------------------------------------------------------------------------
# The sparse puzzle-embedding table
# ----------------------------------------------------------------------------------------------------


class PuzzleEmbedding(nn.Module):
    """A table of per-puzzle embeddings (a buffer, zero-initialised), trained only on the rows in the batch.

    In training (with gradients), forward copies the batch's rows into a leaf tensor that takes the gradient
    (`batch_rows`, with `batch_ids`); SparseSignSGD reads both and its zero_grad clears them. The leaf is made once
    per batch size (`leaf_for`, which HRM.__call__ calls before a compiled forward: a leaf made inside the graph
    broke it) and filled in place under no_grad, as the reference's local_weights buffer. The table is not a
    Parameter, so DDP neither syncs nor broadcasts it: every rank applies the same update to it
    (start_run(..., ddp_kwargs={"broadcast_buffers": False}))."""

    def __init__(self, num_ids: int, dim: int):
        super().__init__()
        self.register_buffer("table", torch.zeros(num_ids, dim))
        self.batch_rows: torch.Tensor | None = None
        self.batch_ids: torch.Tensor | None = None  # None: no training forward since the last zero_grad

    def leaf_for(self, rows: int) -> torch.Tensor:
        """The leaf tensor [rows, dim] that takes the batch rows' gradient, made when there is none of that shape."""
        leaf, table = self.batch_rows, self.table
        if leaf is None or leaf.shape[0] != rows or leaf.dtype != table.dtype or leaf.device != table.device:
            self.batch_rows = leaf = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=table.device,
                                                 requires_grad=True)
            # Filled in place by every training forward: for --cuda-graphs, an input that keeps its address (a
            # graph may then mutate it, as it does parameters and buffers)
            torch._dynamo.mark_static_address(leaf)
        return leaf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.table[ids]
        rows = self.leaf_for(len(ids))
        with torch.no_grad():
            rows.copy_(self.table[ids])
        self.batch_ids = ids
        return rows


def same_id_groups(ids: torch.Tensor) -> torch.Tensor:
    """For each position, a group number shared by the positions holding the same id, and by no other: where the id
    first occurs in the sorted ids (in 0 .. len - 1). Like torch.unique's inverse, but of a size known in advance
    (unique's is read on the host: a sync), in two launches."""
    return torch.searchsorted(torch.sort(ids).values, ids)


class SparseSignSGD:
    """SignSGD with decoupled weight decay on the rows of the table present in the global batch:
    row <- row (1 - lr wd) - lr sign(sum of that row's gradients over every rank's batch).

    The gradients and ids of every rank are gathered (`gather`, Accelerator.gather: rank order), duplicate ids
    summed, and every rank applies the same update, so N processes equal one process with the same global batch.
    """

    def __init__(self, embedding: PuzzleEmbedding, lr: float, weight_decay: float, gather=None):
        self.embedding, self.lr, self.weight_decay = embedding, lr, weight_decay
        self.gather = gather or (lambda tensor: tensor)

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        rows, ids = self.embedding.batch_rows, self.embedding.batch_ids
        if ids is None:
            return
        grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        grads, all_ids = self.gather(grad.float().contiguous()), self.gather(ids.contiguous())
        group = same_id_groups(all_ids)
        summed = torch.zeros_like(grads).index_add_(0, group, grads)  # each id's gradients, in batch order
        table = self.embedding.table
        # Every row of an id gets the same new value, so writing them all (duplicates included) is one update per id.
        updated = table[all_ids] * (1.0 - lr * self.weight_decay) - lr * torch.sign(summed[group]).to(table.dtype)
        table[all_ids] = updated

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The batch's rows and their gradient let go (always set to None: they are made anew each batch)."""
        if self.embedding.batch_rows is not None:
            self.embedding.batch_rows.grad = None
        self.embedding.batch_ids = None


# ----------------------------------------------------------------------------------------------------
# AdamATan2
# ----------------------------------------------------------------------------------------------------


class AdamATan2(torch.optim.Optimizer):
    """Adam with atan2 in place of the division by sqrt(v) + eps (Everett et al. 2024), as adam-atan2 0.0.3 (the
    fused CUDA kernel HRM trains with, csrc/adam_atan2.cu) computes it:

        p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        p <- p - (lr / (1 - b1^t)) atan2(m, sqrt(v) / sqrt(1 - b2^t))

    The first bias correction scales the step outside atan2 (not m inside it): |update| <= lr pi/2 / (1 - b1^t).
    No eps: atan2 is scale invariant."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0):
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or weight_decay < 0:
            raise ValueError(f"invalid AdamATan2 settings lr={lr} betas={betas} weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient, as foreach ops over each group's parameters that share a
        step count, dtype and device (the arithmetic, element by element, of the per-parameter formula above); atan2,
        which has no foreach form, runs once over the moments concatenated (it was a launch per parameter; on a CPU
        an element's atan2 may differ from before in the last bit, as torch's vectorised atan2 and its scalar loop
        for a tensor's last elements can). The step count is a Python number in the state: reading a tensor's on the
        host was a sync per parameter on a GPU."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            by_step: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0.0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = float(state["step"]) + 1  # (a checkpoint of an older version holds a tensor)
                by_step.setdefault((state["step"], p.dtype, p.device), []).append(p)
            for (step, _, _), params in by_step.items():
                grads = [p.grad for p in params]
                ms = [self.state[p]["exp_avg"] for p in params]
                vs = [self.state[p]["exp_avg_sq"] for p in params]
                torch._foreach_mul_(params, 1 - lr * decay)
                torch._foreach_lerp_(ms, grads, 1 - beta1)
                torch._foreach_lerp_(vs, torch._foreach_mul(grads, grads), 1 - beta2)
                denoms = torch.cat([v.reshape(-1) for v in vs]).sqrt_().div_(math.sqrt(1 - beta2**step))
                updates = torch.cat([m.reshape(-1) for m in ms]).atan2_(denoms).split([p.numel() for p in params])
                updates = [u.view_as(p) for u, p in zip(updates, params, strict=True)]
                torch._foreach_add_(params, updates, alpha=-lr / (1 - beta1**step))
        return loss


# ----------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------


# --optimizer adam-atan2, HRM's (no eps: atan2 replaces the division)
register_optimizer("adam-atan2", lambda parameters, *, lr, weight_decay, betas, eps: AdamATan2(
    parameters, lr=lr, betas=betas, weight_decay=weight_decay))


def stablemax_s(x: torch.Tensor) -> torch.Tensor:
    """s(x) = 1 / (1 - x) for x < 0, x + 1 otherwise (positive, monotone, linear growth). (reciprocal: `1.0 / t`
    is reciprocal(t) * 1.0, the same values in two launches)"""
    return torch.where(x < 0, torch.reciprocal(1.0 - x + 1e-30), x + 1.0)


def log_stablemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    s = stablemax_s(x)
    return torch.log(s / s.sum(dim=dim, keepdim=True))


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_LABEL,
                            valid: torch.Tensor | None = None):
    """Per-position -log stablemax(logits)[label] in float64 (0 where label == ignore_index; `valid`, if given, is
    labels != ignore_index)."""
    logprobs = log_stablemax(logits.to(torch.float64))
    valid = labels != ignore_index if valid is None else valid
    picked = logprobs.gather(-1, torch.where(valid, labels, 0).to(torch.long).unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0.0)


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_LABEL,
                          valid: torch.Tensor | None = None):  # (valid: LOSSES' shared signature; not needed here)
    flat = F.cross_entropy(logits.to(at_least_float32(logits.dtype)).flatten(0, -2), labels.to(torch.long).flatten(),
                           ignore_index=ignore_index, reduction="none")
    return flat.view(labels.shape)


LOSSES = {"stablemax": stablemax_cross_entropy, "softmax": softmax_cross_entropy}


SUMS = ("rows", "lm_loss", "q_halt_loss", "q_continue_loss", "count", "token_correct", "blank_correct",
        "blank_cells", "exact_correct", "q_halt_correct", "segments")  # act_losses' sums, in this order


def act_losses(outputs: dict, loss: str = "stablemax") -> tuple[torch.Tensor, dict]:
    """(loss summed over this rank's rows, {name: local sum}): the lm loss (per-row mean over labelled cells,
    every row every segment) + 0.5 (BCE(q_halt, row fully correct) + BCE(q_continue, target)); metrics as sums
    over the rows that halted this segment ("count" of them), so they can be summed over ranks and steps.

    The sums (SUMS) are the elements of one float64 tensor: the per-row metrics summed over the valid rows in one
    reduction and joined to the row count and the three losses in one cat, not an op or two per name (boolean
    indexing, which they used, also reads the mask's count on the host on a GPU: a sync)."""
    labels, logits, halted = outputs["labels"], outputs["logits"], outputs["halted"]
    mask = labels != IGNORE_LABEL
    counts = mask.sum(-1)
    divisor = counts.clamp_min(1).unsqueeze(-1)
    predicted = logits.argmax(-1)
    correct = mask & (predicted == labels)
    correct_counts = correct.sum(-1)
    row_correct = correct_counts == counts
    lm_loss = (LOSSES[loss](logits, labels, valid=mask) / divisor).sum()
    q_halt_loss = F.binary_cross_entropy_with_logits(outputs["q_halt"], row_correct.to(outputs["q_halt"].dtype),
                                                     reduction="sum")
    if outputs.get("target_q_continue") is not None:
        q_continue_loss = F.binary_cross_entropy_with_logits(outputs["q_continue"], outputs["target_q_continue"],
                                                             reduction="sum")
    else:
        q_continue_loss = torch.zeros_like(q_halt_loss)
    total = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)
    with torch.no_grad():
        valid = halted & (counts > 0)
        blanks = outputs["blanks"] & mask
        per_row = torch.stack([valid, correct_counts / divisor.squeeze(-1), (correct & blanks).sum(-1),
                               blanks.sum(-1), row_correct, (outputs["q_halt"] >= 0) == row_correct,
                               outputs["steps"]], dim=-1)
        metrics = (per_row * valid.unsqueeze(-1)).sum(0, dtype=torch.float64)  # finite and >= 0: x 0 = 0
        losses = [part.detach().view(1) for part in (lm_loss, q_halt_loss, q_continue_loss)]
        sums = torch.cat([_constant(float(len(labels)), labels.device), *losses, metrics])
    return total, dict(zip(SUMS, sums.unbind(), strict=True))


_CONSTANTS: dict = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float64 [1] tensor of this value on this device, made once (not a host-to-device copy every step)."""
    key = (value, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor([value], dtype=torch.float64, device=device)
    return _CONSTANTS[key]


def ratios(sums: dict, prefix: str = "train") -> dict:
    """Logged metrics from summed counts (over ranks and steps): sums divided by counts."""
    rows = max(float(sums["rows"]), 1.0)
    out = {f"{prefix}/lm_loss": float(sums["lm_loss"]) / rows,
           f"{prefix}/q_halt_loss": float(sums["q_halt_loss"]) / rows,
           f"{prefix}/q_continue_loss": float(sums["q_continue_loss"]) / rows}
    count = float(sums["count"])
    if count > 0:  # nothing halted yet: accuracies are undefined, not 0
        out.update({
            f"{prefix}/token_accuracy": float(sums["token_correct"]) / count,
            f"{prefix}/blank_accuracy": float(sums["blank_correct"]) / max(float(sums["blank_cells"]), 1.0),
            f"{prefix}/exact_accuracy": float(sums["exact_correct"]) / count,
            f"{prefix}/q_halt_accuracy": float(sums["q_halt_correct"]) / count,
            f"{prefix}/mean_segments": float(sums["segments"]) / count,
        })
    return out


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------


def fold_key(prefix: torch.Tensor | int, key: torch.Tensor) -> torch.Tensor:
    """keyed_hash(*keys, key) from prefix = keyed_hash(*keys) or keyed_hash_int(*keys) (broadcasting with key):
    keyed_hash's step for one key, bit for bit, so the integer keys before it are hashed on the host, not in a dozen
    launches each. keyed_hash's prefix ^ (key & M) ^ ((key >> 32) & M) * C & M, as (prefix ^ key ^ (key >> 32) C) & M:
    & M distributes over ^, prefix < 2**32, and (a & M) C = a C modulo 2**32 (|a C| < 2**61, no overflow)."""
    key = key.to(torch.int64)
    return mix32((prefix ^ key ^ (key >> 32) * 0x27D4EB2F) & MASK32)


class HRM(nn.Module):
    """forward(carry, batch, explore) -> outputs; `initial_carry(batch_size)` makes the first carry.

    batch: {"inputs" [B, seq] tokens, "labels" [B, seq], "puzzle_ids" [B], "ids" [B] sample ids}.
    explore_key: (seed, purpose, step), training only: each row's exploration coin and forced minimum of
    2..halt_max_steps segments are keyed_uniform(*explore_key, 0 or 1, sample id), the same on any rank.
    outputs: logits, q_halt, q_continue, target_q_continue (training), steps, halted, labels, blanks and the
    new carry (all detached), which the caller keeps for the next batch.
    """

    def __init__(self, vocab: int, seq_len: int, num_puzzle_ids: int = 1, hidden: int = 512, heads: int = 8,
                 expansion: float = 4.0, h_layers: int = 4, l_layers: int = 4, h_cycles: int = 2, l_cycles: int = 2,
                 halt_max_steps: int = 16, exploration_prob: float = 0.1, positions: str = "rope"):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.seq_len, self.hidden = seq_len, hidden
        self.h_cycles, self.l_cycles = h_cycles, l_cycles
        self.halt_max_steps, self.exploration_prob = halt_max_steps, exploration_prob
        # keyed_uniform(...) < p <=> its hash (the uniform x 2**32, an integer) < ceil(p 2**32): exact
        self.coin_threshold = math.ceil(exploration_prob * 2**32)
        self.puzzle_len = 1  # one puzzle-embedding token prepended (puzzle_emb_ndim = hidden)
        total = seq_len + self.puzzle_len
        self.embed_scale = math.sqrt(hidden)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        trunc_normal_(self.embed_tokens.weight, 1.0 / self.embed_scale)
        self.puzzle_emb = PuzzleEmbedding(num_puzzle_ids, hidden)
        if positions == "rope":
            self.rotary, self.embed_pos = Rotary(hidden // heads, total, heads), None
        elif positions == "learned":
            self.rotary = None
            self.embed_pos = nn.Parameter(trunc_normal_(torch.empty(total, hidden), 1.0 / self.embed_scale))
        else:
            raise ValueError(f"positions must be rope or learned, not {positions!r}")
        self.h_level = ReasoningModule(h_layers, hidden, heads, expansion)
        self.l_level = ReasoningModule(l_layers, hidden, heads, expansion)
        self.lm_head = Linear(hidden, vocab)
        self.q_head = nn.Linear(hidden, 2, bias=True)
        with torch.no_grad():  # Q starts at sigmoid(-5): "continue" and "halt" both unlikely to be right
            self.q_head.weight.zero_()
            self.q_head.bias.fill_(-5.0)
        self.register_buffer("h_init", trunc_normal_(torch.empty(hidden), 1.0))
        self.register_buffer("l_init", trunc_normal_(torch.empty(hidden), 1.0))

    # ---- one segment --------------------------------------------------------------------------------------
    def embed(self, inputs: torch.Tensor, puzzle_ids: torch.Tensor) -> torch.Tensor:
        tokens = self.embed_tokens(inputs.to(torch.long))
        puzzle = self.puzzle_emb(puzzle_ids).to(tokens.dtype).view(-1, self.puzzle_len, self.hidden)
        x = torch.cat([puzzle, tokens], dim=1)
        if self.embed_pos is not None:
            x = 0.707106781 * (x + self.embed_pos.to(x.dtype))
        return x.mul_(self.embed_scale)  # over x, this call's own temporary (no backward reads it)

    def segment(self, z_h: torch.Tensor, z_l: torch.Tensor, x: torch.Tensor, logits: bool = True):
        """(z_h, z_l, logits [B, seq, vocab] (None without `logits`), q [B, 2] float32) from the embedded input x:
        H_cycles x L_cycles updates, the last L and H update with gradient (one-step gradient). Without `logits`
        (the target-Q segment: q alone), H's last block computes the first position only (the one q reads; its
        query against every position's key and value), and the z_h returned is that position's [B, 1, hidden]."""
        with torch.no_grad():
            for h in range(self.h_cycles):
                for l_step in range(self.l_cycles):
                    if not (h == self.h_cycles - 1 and l_step == self.l_cycles - 1):
                        z_l = self.l_level(z_l, z_h + x, self.rotary, injection_is_temporary=True)
                if h != self.h_cycles - 1:
                    z_h = self.h_level(z_h, z_l, self.rotary)
        z_l = self.l_level(z_l, z_h + x, self.rotary, injection_is_temporary=True)
        z_h = self.h_level(z_h, z_l, self.rotary, first_only=not logits)
        logits = self.lm_head(z_h)[:, self.puzzle_len:] if logits else None
        q = self.q_head(z_h[:, 0])
        q = q.to(at_least_float32(q.dtype))
        return z_h, z_l, logits, q

    # ---- ACT across segments -------------------------------------------------------------------------------
    def initial_carry(self, batch: dict) -> dict:
        """Every row halted, so the first batch fills all of them."""
        rows = len(batch["inputs"])
        device = batch["inputs"].device
        state = torch.zeros(rows, self.seq_len + self.puzzle_len, self.hidden, device=device, dtype=self.h_init.dtype)
        return {
            "z_h": state.clone(), "z_l": state.clone(),
            "steps": torch.zeros(rows, dtype=torch.int32, device=device),
            "halted": torch.ones(rows, dtype=torch.bool, device=device),
            **{f"data_{k}": torch.zeros_like(v) for k, v in batch.items()},
        }

    def exploration_key(self, explore_key: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
        """[2, 1] int64: keyed_hash_int(*explore_key, purpose) for purpose 0 (the coin) and 1 (the minimum), on the
        host; forward folds each row's sample id in (`fold_key`), giving keyed_hash(*explore_key, purpose, id)."""
        return torch.tensor([[keyed_hash_int(*explore_key, 0)], [keyed_hash_int(*explore_key, 1)]], device=device)

    def __call__(self, carry: dict, batch: dict, explore_key: tuple[int, ...] | None = None) -> dict:
        """Module.__call__ with the host's part done first, outside a compiled forward (--compile compiles what
        Module.__call__ calls): the exploration key hashed into a tensor (a step number in the graph recompiled it
        every step) and the puzzle-embedding rows' leaf made for this batch size (made in the graph, it broke it)."""
        if explore_key is not None and not isinstance(explore_key, torch.Tensor):
            explore_key = self.exploration_key(explore_key, carry["halted"].device)
        if self.training and torch.is_grad_enabled():
            self.puzzle_emb.leaf_for(len(carry["halted"]))
        return super().__call__(carry, batch, explore_key)

    def forward(self, carry: dict, batch: dict, explore_key: torch.Tensor | tuple[int, ...] | None = None) -> dict:
        """explore_key: (seed, purpose, step), or exploration_key's tensor of it (what __call__ passes)."""
        halted = carry["halted"]
        rows = halted.view(-1, 1, 1)
        z_h = torch.where(rows, self.h_init.to(carry["z_h"].dtype), carry["z_h"])
        z_l = torch.where(rows, self.l_init.to(carry["z_l"].dtype), carry["z_l"])
        steps = torch.where(halted, 0, carry["steps"])
        data = {k: torch.where(halted.view(-1, *[1] * (v.dim() - 1)), v, carry[f"data_{k}"])
                for k, v in batch.items()}

        x = self.embed(data["inputs"], data["puzzle_ids"])
        z_h, z_l, logits, q = self.segment(z_h, z_l, x)
        q_halt, q_continue = q.unbind(-1)
        target_q_continue = None
        with torch.no_grad():
            steps = steps + 1
            last = steps >= self.halt_max_steps
            new_halted = last
            if self.training and self.halt_max_steps > 1:
                new_halted = new_halted | (q_halt > q_continue)
                if explore_key is not None:  # coins of the rows' samples: the same on any rank, any process count
                    if not isinstance(explore_key, torch.Tensor):  # forward called directly, not through __call__
                        explore_key = self.exploration_key(explore_key, halted.device)
                    # keyed_uniform(*key, 0, id) < p and 2 + floor(keyed_uniform(*key, 1, id) (max - 1)), computed
                    # on the hashes (the uniforms x 2**32, exact integers): the same decisions
                    coin, draw = fold_key(explore_key, data["ids"]).unbind()
                    minimum = torch.where(coin < self.coin_threshold, 2 + (draw * (self.halt_max_steps - 1) >> 32), 0)
                    new_halted = new_halted & (steps >= minimum)
                # Q-learning target for "continue": the next segment's value, bootstrapped without a target network
                # (the same embedded input: computed again, it was the same values)
                _, _, _, next_q = self.segment(z_h, z_l, x, logits=False)
                target_q_continue = torch.sigmoid(torch.where(last, next_q[:, 0], next_q.max(dim=-1).values))
        new_carry = {"z_h": z_h.detach(), "z_l": z_l.detach(), "steps": steps, "halted": new_halted,
                     **{f"data_{k}": v for k, v in data.items()}}
        return {
            "logits": logits, "q_halt": q_halt, "q_continue": q_continue, "target_q_continue": target_q_continue,
            "steps": steps, "halted": new_halted, "labels": data["labels"], "blanks": data["inputs"] == 1,
            "carry": new_carry,
        }
