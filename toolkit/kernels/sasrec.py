"""SASRec's fast paths: toolkit/models/sasrec.py's SelfAttention and FeedForward, faster (most in float32 on the CPU).

Swapped in by toolkit.kernels when a run builds the model (`--kernels auto`), and proven equal to the model file's
code at every start; each takes its fast path where it applies and the model's own code (`super()`) everywhere else.

- Linear layers (q, k and v's products, the output's, the FFN's) by toolkit.kernels.onednn's `linear`: in float32 on
  the CPU (eager) oneDNN's inner product with its backward written out (or MKL's GEMM where MKL runs AVX-512
  kernels), 1.8-2.6x F.linear at these sizes: F.linear called MKL's GEMM, which ran SASRec's [25600, 50] x [50, 50]
  at ~42-56 GFLOP/s on an AMD EPYC. F.linear itself everywhere else (CUDA, other dtypes, autocast, torch.compile).
- The attention with dropout on its weights (SASRec's, training; not TiSASRec's), on every device:
  `packed_causal_attention_with_dropout`, the queries in chunks whose keys stop where the chunk's queries do, so the
  all-future blocks right of the diagonal are never computed, forward or backward (4 chunks at maxlen 200 on the CPU:
  37.5% of the [L, L] weights skipped), and the backward written out (`CausalAttention`), straight into the gradient
  of q, k and v side by side. Its dropout mask is the model's own (`attention_keep`, laid out for the computed blocks
  by the model's `query_chunks`): the same random numbers as the model file's formula, in the same places.
  Without dropout and for TiSASRec, the model's own attention (`attend`) between the oneDNN products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from toolkit.kernels import onednn, replaces
from toolkit.kernels.onednn import linear
from toolkit.models import sasrec
from toolkit.run.randomness import keyed_dropout


@replaces(sasrec.SelfAttention)
class SelfAttention(sasrec.SelfAttention):
    """Products by oneDNN (`linear`); with dropout on the attention weights (not time-aware, training): the chunked
    attention (packed_causal_attention_with_dropout); else the model's own attention between the products. Where
    neither applies (no dropout there, and not float32 on the CPU), the model's own code."""

    def forward(self, query_in, kv_in, positions=None, intervals=None) -> torch.Tensor:
        chunked = not self.time_aware and self.training and self.dropout > 0.0
        if not chunked and not onednn.eligible(query_in, self.query.weight):
            return super().forward(query_in, kv_in, positions, intervals)
        if query_in is kv_in:  # self-attention: one [d, 3d] product
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            qkv = linear(query_in, weight, bias)  # [B, L, 3d]: q, k, v side by side
        else:  # the original placement: the query from LN(u), keys and values from u in one [d, 2d] product
            weight, bias = torch.cat([self.key.weight, self.value.weight]), torch.cat([self.key.bias, self.value.bias])
            qkv = torch.cat([linear(query_in, self.query.weight, self.query.bias), linear(kv_in, weight, bias)], -1)
        if chunked:
            out = packed_causal_attention_with_dropout(qkv, self.heads, self.dropout)
        else:
            out = self.attend(qkv, positions, intervals)
        return linear(out, self.out.weight, self.out.bias)


@replaces(sasrec.FeedForward)
class FeedForward(sasrec.FeedForward):
    """Both products by oneDNN (`linear`) in float32 on the CPU; else the model's own code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not onednn.eligible(x, self.inner.weight):
            return super().forward(x)
        x = F.relu(keyed_dropout(linear(x, self.inner.weight, self.inner.bias), self.dropout, self.training))
        return keyed_dropout(linear(x, self.outer.weight, self.outer.bias), self.dropout, self.training)


def causal_attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """The model's causal_attention_with_dropout, the same mask, in chunks: softmax(q k^T / sqrt(d_h), future
    masked) with keyed dropout on the weights, @ v; q, k, v: [B, h, L, d_h] (packed_causal_attention_with_dropout on
    q, k, v side by side; the result as [B, h, L, d_h])."""
    batch, heads, length, dim = q.shape
    qkv = torch.cat([t.transpose(1, 2).flatten(-2) for t in (q, k, v)], dim=-1)
    return packed_causal_attention_with_dropout(qkv, heads, p).view(batch, length, heads, dim).transpose(1, 2)


def packed_causal_attention_with_dropout(qkv: torch.Tensor, heads: int, p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_h), future masked) with keyed dropout on the weights, @ v, for q, k, v side by side in
    qkv [B, L, 3d] (h heads of d_h = d / h each); the heads' outputs side by side: [B, L, d].

    Written for the CPU, where this is most of SASRec's step at maxlen 200 (the weights are [B, h, L, L]):
    - the queries go in chunks (the model's query_chunks), and a chunk's keys stop where its queries do: the
      all-future blocks right of the diagonal are never computed, forward or backward (4 chunks: 37.5% of the
      weights skipped);
    - the dropout mask is drawn for the computed blocks only (the model's attention_keep, which lays it out for
      them): per sample, head after head, chunk after chunk, each block [rows, stop] row by row, from keyed_keep (a
      sample's mask does not depend on the rank), 0 or 1 / (1 - p);
    - the backward is written out (CausalAttention), straight into qkv's gradient.
    """
    batch, length, width = qkv.shape
    chunks = sasrec.query_chunks(length, qkv.device)
    keep = sasrec.attention_keep(batch, heads, chunks, p, device=qkv.device, dtype=qkv.dtype)
    return CausalAttention.apply(qkv, keep.view(batch * heads, keep.shape[1] // heads), chunks, heads)


class CausalAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d_h) + causal mask) * keep @ v by query chunks, q, k, v side by side in qkv [B, L, 3d];
    keep: [B * h, sum of rows * stop], the dropout mask (0 or 1 / (1 - p)) of the computed blocks, chunk after chunk.

    Forward per chunk: one product of the chunk's queries with the keys up to its end, scaled inside it, -inf added
    right of the diagonal in its last [rows, rows] block only, softmax, the mask, one product into the output. The
    backward of each product is one product, written into qkv's gradient (the last chunk's, which spans every key,
    first; the others add into it): no zero-filled gradient per slice summed afterwards, as autograd does for
    slices, and no concatenation of q, k and v's gradients. With one head, q, k and v are views of qkv (row stride
    3d), which the products read as they are; with more, each is copied to [B * h, L, d_h]. Products written into a
    slice are bmm(out=...): baddbmm into a strided output falls back to one addmm per sample on the CPU."""

    @staticmethod
    def forward(ctx, qkv, keep, chunks, heads):
        batch, length, width = qkv.shape
        q, k, v = (_heads_first(t, heads) for t in qkv.chunk(3, dim=-1))
        count, _, dim = q.shape
        out = q.new_empty(count, length, dim)
        saved, offset = [], 0
        with torch.autocast(q.device.type, enabled=False):  # in the inputs' dtype (autocast's products came before)
            for start, stop in chunks:
                rows = stop - start
                logits = torch.baddbmm(q.new_empty(()), q[:, start:stop], k[:, :stop].transpose(1, 2), beta=0.0,
                                       alpha=1.0 / math.sqrt(dim))  # (input ignored with beta = 0)
                future = torch.full((rows, rows), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
                logits[:, :, start:].add_(future)  # x + 0 = x, x + -inf = -inf
                weights = logits.softmax(-1)
                dropped = weights * keep[:, offset:offset + rows * stop].view(count, rows, stop)
                offset += rows * stop
                torch.bmm(dropped, v[:, :stop], out=out[:, start:stop])
                saved += [weights, dropped]
        ctx.chunks, ctx.heads = chunks, heads
        ctx.save_for_backward(qkv, keep, *saved)
        return out if heads == 1 else out.view(batch, heads, length, dim).transpose(1, 2).reshape(batch, length, -1)

    @staticmethod
    def backward(ctx, grad):
        qkv, keep, *saved = ctx.saved_tensors
        chunks, heads = ctx.chunks, ctx.heads
        q, k, v = (_heads_first(t, heads) for t in qkv.chunk(3, dim=-1))
        grad = _heads_first(grad, heads)
        count, length, dim = q.shape
        grad_qkv = qkv.new_empty(qkv.shape)
        grad_q, grad_k, grad_v = (grad_qkv.chunk(3, dim=-1) if heads == 1 else
                                  (q.new_empty(count, length, dim) for _ in range(3)))
        offsets = [0]
        for start, stop in chunks:
            offsets.append(offsets[-1] + (stop - start) * stop)
        with torch.autocast(q.device.type, enabled=False):
            for index in reversed(range(len(chunks))):  # the last chunk spans every key: it writes first
                start, stop = chunks[index]
                rows, first = stop - start, index == len(chunks) - 1
                weights, dropped = saved[2 * index], saved[2 * index + 1]
                grad_c = grad[:, start:stop]
                if first:
                    torch.bmm(dropped.transpose(1, 2), grad_c, out=grad_v)
                else:
                    grad_v[:, :stop].add_(torch.bmm(dropped.transpose(1, 2), grad_c))
                grad_dropped = torch.bmm(grad_c, v[:, :stop].transpose(1, 2))
                grad_dropped.mul_(keep[:, offsets[index]:offsets[index + 1]].view(count, rows, stop))
                grad_logits = torch._softmax_backward_data(grad_dropped, weights, -1, weights.dtype)
                torch.bmm(grad_logits, k[:, :stop], out=grad_q[:, start:stop])
                if first:
                    torch.bmm(grad_logits.transpose(1, 2), q[:, start:stop], out=grad_k)
                else:
                    grad_k[:, :stop].add_(torch.bmm(grad_logits.transpose(1, 2), q[:, start:stop]))
            grad_q.mul_(1.0 / math.sqrt(dim)), grad_k.mul_(1.0 / math.sqrt(dim))
        if heads > 1:
            for part, grad_part in zip(grad_qkv.chunk(3, dim=-1), (grad_q, grad_k, grad_v), strict=True):
                part.view(-1, length, heads, dim).copy_(grad_part.view(-1, heads, length, dim).transpose(1, 2))
        return grad_qkv, None, None, None


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, h * d_h] -> [B * h, L, d_h]: a view with one head, a copy with more."""
    if heads == 1:
        return x
    return x.unflatten(-1, (heads, -1)).transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1] // heads)
