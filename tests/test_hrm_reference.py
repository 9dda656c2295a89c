"""Our HRM and loss head against the reference implementation, transcribed here for the CPU from reading
sapientinc/HRM (commit 42410da: models/hrm/hrm_act_v1.py, models/layers.py, models/losses.py,
models/sparse_embedding.py), with the same weights (our state dict mapped onto its names), in float64.

Train mode, several ACT segments with the carry passed on (halted rows take new rows, running rows keep theirs): the
same logits, Q values, Q targets, halting decisions, step counts, losses and metrics, and the same gradients of every
weight and of the puzzle-embedding rows; then one SGD step of the weights and the reference's SignSGD step of the
embedding table on both sides, so later segments run on trained weights. Eval mode: every segment alike, halting
only at the last. Once with RoPE and stablemax, once with learned positions and softmax.

What the transcription changes, and why (nothing else is changed):
- FlashAttention's flash_attn_func([B, L, H, D], causal=False) is scaled_dot_product_attention on [B, H, L, D] (the
  same default scale 1/sqrt(head_dim)); it needs CUDA.
- forward_dtype is float64 (bfloat16 there), and the reference's casts to float32 (rms_norm, RoPE, the Q logits,
  softmax cross-entropy) are casts to at least float32, so a float64 check is not rounded to float32 on the way
  (ours does the same); softmax_cross_entropy's view is a reshape, as the float64 logits are not copied by the cast.
- Exploration draws (torch.rand_like, torch.randint_like) are given: the coins our model draws for the same rows
  (keyed by sample), so both sides explore the same rows to the same minimum.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toolkit.models.hrm import HRM, SparseSignSGD, act_losses
from toolkit.run.randomness import keyed_uniform

VOCAB, SEQ, ROWS, SEGMENTS, MAX_STEPS = 11, 12, 6, 7, 4
SEED, EXPLORATION = 3, 11
F64 = torch.float64


def at_least_float32(dtype):
    return torch.promote_types(dtype, torch.float32)


# ---- the reference, transcribed (its names) ---------------------------------------------------------------------


def rms_norm(hidden_states, variance_epsilon):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(at_least_float32(input_dtype))
    variance = hidden_states.square().mean(-1, keepdim=True)
    return (hidden_states * torch.rsqrt(variance + variance_epsilon)).to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):  # q, k [bs, seq, heads, head_dim]; cos, sin [seq, head_dim]
    orig_dtype = q.dtype
    q, k = q.to(cos.dtype), k.to(cos.dtype)
    q_embed = q * cos.unsqueeze(-2) + rotate_half(q) * sin.unsqueeze(-2)
    k_embed = k * cos.unsqueeze(-2) + rotate_half(k) * sin.unsqueeze(-2)
    return q_embed.to(orig_dtype), k_embed.to(orig_dtype)


class CastedLinear(nn.Module):
    def __init__(self, in_features, out_features, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), bias=self.bias.to(x.dtype) if self.bias is not None else None)


class CastedEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, cast_to):
        super().__init__()
        self.cast_to = cast_to
        self.embedding_weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, x):
        return F.embedding(x, self.embedding_weight.to(self.cast_to))


class CastedSparseEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, batch_size, cast_to):
        super().__init__()
        self.cast_to = cast_to
        self.weights = nn.Buffer(torch.zeros(num_embeddings, embedding_dim), persistent=True)
        self.local_weights = nn.Buffer(torch.zeros(batch_size, embedding_dim, requires_grad=True), persistent=False)
        self.local_ids = nn.Buffer(torch.zeros(batch_size, dtype=torch.int32), persistent=False)

    def forward(self, inputs):
        if not self.training:
            return self.weights[inputs].to(self.cast_to)
        with torch.no_grad():
            self.local_weights.copy_(self.weights[inputs])
            self.local_ids.copy_(inputs)
        return self.local_weights.to(self.cast_to)


def sparse_emb_signsgd(local_weights_grad, local_ids, weights, lr, weight_decay):  # world_size 1
    grad_ids, inv = local_ids.unique(return_inverse=True)
    grad = torch.zeros(grad_ids.shape[0], local_weights_grad.shape[1], dtype=local_weights_grad.dtype)
    grad.scatter_add_(0, inv.unsqueeze(-1).expand(-1, local_weights_grad.shape[1]), local_weights_grad)
    p = weights[grad_ids]
    p.mul_(1.0 - lr * weight_decay).add_(torch.sign(grad), alpha=-lr)
    weights[grad_ids] = p


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 as there, held in the forward dtype (module.double() does this to the buffers)
        self.cos_cached = nn.Buffer(emb.cos().to(F64), persistent=False)
        self.sin_cached = nn.Buffer(emb.sin().to(F64), persistent=False)

    def forward(self):
        return self.cos_cached, self.sin_cached


class Attention(nn.Module):
    def __init__(self, hidden_size, head_dim, num_heads):
        super().__init__()
        self.hidden_size, self.head_dim, self.num_heads = hidden_size, head_dim, num_heads
        self.output_size = head_dim * num_heads
        self.qkv_proj = CastedLinear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.o_proj = CastedLinear(self.output_size, hidden_size, bias=False)

    def forward(self, cos_sin, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(batch_size, seq_len, 3 * self.num_heads, self.head_dim)
        query = qkv[:, :, : self.num_heads]
        key = qkv[:, :, self.num_heads: 2 * self.num_heads]
        value = qkv[:, :, 2 * self.num_heads:]
        if cos_sin is not None:
            query, key = apply_rotary_pos_emb(query, key, *cos_sin)
        # flash_attn_func(q, k, v, causal=False) -> SDPA (heads before positions)
        attn_output = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                     value.transpose(1, 2), is_causal=False).transpose(1, 2)
        return self.o_proj(attn_output.reshape(batch_size, seq_len, self.output_size))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size, expansion):
        super().__init__()
        inter = -(round(expansion * hidden_size * 2 / 3) // -256) * 256
        self.gate_up_proj = CastedLinear(hidden_size, inter * 2, bias=False)
        self.down_proj = CastedLinear(inter, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config.hidden_size, config.hidden_size // config.num_heads, config.num_heads)
        self.mlp = SwiGLU(config.hidden_size, config.expansion)
        self.norm_eps = config.rms_norm_eps

    def forward(self, cos_sin, hidden_states):
        hidden_states = rms_norm(hidden_states + self.self_attn(cos_sin=cos_sin, hidden_states=hidden_states),
                                 variance_epsilon=self.norm_eps)
        return rms_norm(hidden_states + self.mlp(hidden_states), variance_epsilon=self.norm_eps)


class ReasoningModule(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden_states, input_injection, **kwargs):
        hidden_states = hidden_states + input_injection
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states, **kwargs)
        return hidden_states


class Inner(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.forward_dtype = config, F64
        self.embed_scale = math.sqrt(config.hidden_size)
        self.embed_tokens = CastedEmbedding(config.vocab_size, config.hidden_size, cast_to=self.forward_dtype)
        self.lm_head = CastedLinear(config.hidden_size, config.vocab_size, bias=False)
        self.q_head = CastedLinear(config.hidden_size, 2, bias=True)
        self.puzzle_emb_len = -(config.puzzle_emb_ndim // -config.hidden_size)
        self.puzzle_emb = CastedSparseEmbedding(config.num_puzzle_identifiers, config.puzzle_emb_ndim,
                                                batch_size=config.batch_size, cast_to=self.forward_dtype)
        if config.pos_encodings == "rope":
            self.rotary_emb = RotaryEmbedding(config.hidden_size // config.num_heads,
                                              config.seq_len + self.puzzle_emb_len, config.rope_theta)
        else:
            self.embed_pos = CastedEmbedding(config.seq_len + self.puzzle_emb_len, config.hidden_size,
                                             cast_to=self.forward_dtype)
        self.H_level = ReasoningModule([Block(config) for _ in range(config.H_layers)])
        self.L_level = ReasoningModule([Block(config) for _ in range(config.L_layers)])
        self.H_init = nn.Buffer(torch.empty(config.hidden_size, dtype=self.forward_dtype), persistent=True)
        self.L_init = nn.Buffer(torch.empty(config.hidden_size, dtype=self.forward_dtype), persistent=True)

    def _input_embeddings(self, input, puzzle_identifiers):
        embedding = self.embed_tokens(input.to(torch.int32))
        puzzle_embedding = self.puzzle_emb(puzzle_identifiers)
        pad_count = self.puzzle_emb_len * self.config.hidden_size - puzzle_embedding.shape[-1]
        if pad_count > 0:
            puzzle_embedding = F.pad(puzzle_embedding, (0, pad_count))
        embedding = torch.cat((puzzle_embedding.view(-1, self.puzzle_emb_len, self.config.hidden_size), embedding),
                              dim=-2)
        if self.config.pos_encodings == "learned":
            embedding = 0.707106781 * (embedding + self.embed_pos.embedding_weight.to(self.forward_dtype))
        return self.embed_scale * embedding

    def empty_carry(self, batch_size):
        shape = (batch_size, self.config.seq_len + self.puzzle_emb_len, self.config.hidden_size)
        return SimpleNamespace(z_H=torch.empty(shape, dtype=self.forward_dtype),
                               z_L=torch.empty(shape, dtype=self.forward_dtype))

    def reset_carry(self, reset_flag, carry):
        return SimpleNamespace(z_H=torch.where(reset_flag.view(-1, 1, 1), self.H_init, carry.z_H),
                               z_L=torch.where(reset_flag.view(-1, 1, 1), self.L_init, carry.z_L))

    def forward(self, carry, batch):
        seq_info = dict(cos_sin=self.rotary_emb() if hasattr(self, "rotary_emb") else None)
        input_embeddings = self._input_embeddings(batch["inputs"], batch["puzzle_identifiers"])
        with torch.no_grad():
            z_H, z_L = carry.z_H, carry.z_L
            for _H_step in range(self.config.H_cycles):
                for _L_step in range(self.config.L_cycles):
                    if not (_H_step == self.config.H_cycles - 1 and _L_step == self.config.L_cycles - 1):
                        z_L = self.L_level(z_L, z_H + input_embeddings, **seq_info)
                if not _H_step == self.config.H_cycles - 1:
                    z_H = self.H_level(z_H, z_L, **seq_info)
        assert not z_H.requires_grad and not z_L.requires_grad
        z_L = self.L_level(z_L, z_H + input_embeddings, **seq_info)
        z_H = self.H_level(z_H, z_L, **seq_info)
        new_carry = SimpleNamespace(z_H=z_H.detach(), z_L=z_L.detach())
        output = self.lm_head(z_H)[:, self.puzzle_emb_len:]
        q_logits = self.q_head(z_H[:, 0])
        q_logits = q_logits.to(at_least_float32(q_logits.dtype))
        return new_carry, output, (q_logits[..., 0], q_logits[..., 1])


class ACT(nn.Module):
    def __init__(self, config, exploration_draws):
        super().__init__()
        self.config, self.inner = config, Inner(config)
        self.exploration_draws = exploration_draws  # (rand_like, randint_like) of the reference, given

    def initial_carry(self, batch):
        batch_size = batch["inputs"].shape[0]
        return SimpleNamespace(inner_carry=self.inner.empty_carry(batch_size),
                               steps=torch.zeros(batch_size, dtype=torch.int32),
                               halted=torch.ones(batch_size, dtype=torch.bool),
                               current_data={k: torch.empty_like(v) for k, v in batch.items()})

    def forward(self, carry, batch):
        new_inner_carry = self.inner.reset_carry(carry.halted, carry.inner_carry)
        new_steps = torch.where(carry.halted, 0, carry.steps)
        new_current_data = {k: torch.where(carry.halted.view((-1,) + (1,) * (batch[k].ndim - 1)), batch[k], v)
                            for k, v in carry.current_data.items()}
        new_inner_carry, logits, (q_halt_logits, q_continue_logits) = self.inner(new_inner_carry, new_current_data)
        outputs = {"logits": logits, "q_halt_logits": q_halt_logits, "q_continue_logits": q_continue_logits}
        with torch.no_grad():
            new_steps = new_steps + 1
            is_last_step = new_steps >= self.config.halt_max_steps
            halted = is_last_step
            if self.training and self.config.halt_max_steps > 1:
                halted = halted | (q_halt_logits > q_continue_logits)
                uniform, randint = self.exploration_draws(new_current_data)
                min_halt_steps = (uniform < self.config.halt_exploration_prob) * randint
                halted = halted & (new_steps >= min_halt_steps)
                next_q_halt_logits, next_q_continue_logits = self.inner(new_inner_carry, new_current_data)[-1]
                outputs["target_q_continue"] = torch.sigmoid(torch.where(
                    is_last_step, next_q_halt_logits, torch.maximum(next_q_halt_logits, next_q_continue_logits)))
        return SimpleNamespace(inner_carry=new_inner_carry, steps=new_steps, halted=halted,
                               current_data=new_current_data), outputs


IGNORE_LABEL_ID = -100


def s(x, epsilon=1e-30):
    return torch.where(x < 0, 1 / (1 - x + epsilon), x + 1)


def stablemax_cross_entropy(logits, labels, ignore_index=-100):
    s_x = s(logits.to(F64))
    logprobs = torch.log(s_x / torch.sum(s_x, dim=-1, keepdim=True))
    valid_mask = labels != ignore_index
    transformed_labels = torch.where(valid_mask, labels, 0)
    prediction_logprobs = torch.gather(logprobs, index=transformed_labels.to(torch.long).unsqueeze(-1),
                                       dim=-1).squeeze(-1)
    return -torch.where(valid_mask, prediction_logprobs, 0)


def softmax_cross_entropy(logits, labels, ignore_index=-100):
    # reshape for view: there the cast to float32 copies the (sliced, not contiguous) logits; a float64 one does not
    return F.cross_entropy(logits.to(at_least_float32(logits.dtype)).reshape(-1, logits.shape[-1]),
                           labels.to(torch.long).view(-1), ignore_index=ignore_index, reduction="none"
                           ).view(labels.shape)


class ACTLossHead(nn.Module):
    def __init__(self, model, loss_type):
        super().__init__()
        self.model = model
        self.loss_fn = {"stablemax_cross_entropy": stablemax_cross_entropy,
                        "softmax_cross_entropy": softmax_cross_entropy}[loss_type]

    def forward(self, **model_kwargs):
        new_carry, outputs = self.model(**model_kwargs)
        labels = new_carry.current_data["labels"]
        with torch.no_grad():
            mask = labels != IGNORE_LABEL_ID
            loss_counts = mask.sum(-1)
            loss_divisor = loss_counts.clamp_min(1).unsqueeze(-1)
            is_correct = mask & (torch.argmax(outputs["logits"], dim=-1) == labels)
            seq_is_correct = is_correct.sum(-1) == loss_counts
            valid_metrics = new_carry.halted & (loss_counts > 0)
            metrics = {
                "count": valid_metrics.sum(),
                "accuracy": torch.where(valid_metrics, (is_correct.to(torch.float32) / loss_divisor).sum(-1), 0).sum(),
                "exact_accuracy": (valid_metrics & seq_is_correct).sum(),
                "q_halt_accuracy": (valid_metrics & ((outputs["q_halt_logits"] >= 0) == seq_is_correct)).sum(),
                "steps": torch.where(valid_metrics, new_carry.steps, 0).sum(),
            }
        lm_loss = (self.loss_fn(outputs["logits"], labels, ignore_index=IGNORE_LABEL_ID) / loss_divisor).sum()
        q_halt_loss = F.binary_cross_entropy_with_logits(outputs["q_halt_logits"],
                                                         seq_is_correct.to(outputs["q_halt_logits"].dtype),
                                                         reduction="sum")
        metrics.update({"lm_loss": lm_loss.detach(), "q_halt_loss": q_halt_loss.detach()})
        q_continue_loss = 0
        if "target_q_continue" in outputs:
            q_continue_loss = F.binary_cross_entropy_with_logits(outputs["q_continue_logits"],
                                                                 outputs["target_q_continue"], reduction="sum")
            metrics["q_continue_loss"] = q_continue_loss.detach()
        return new_carry, lm_loss + 0.5 * (q_halt_loss + q_continue_loss), metrics, outputs, new_carry.halted.all()


# ---- ours against it ----------------------------------------------------------------------------------------------

NAMES = [  # our parameter and buffer names -> the reference's (ACTLossHead(model=ACT(inner=...)))
    (r"^embed_tokens\.weight$", "model.inner.embed_tokens.embedding_weight"),
    (r"^embed_pos$", "model.inner.embed_pos.embedding_weight"),
    (r"^puzzle_emb\.table$", "model.inner.puzzle_emb.weights"),
    (r"^lm_head\.weight$", "model.inner.lm_head.weight"),
    (r"^q_head\.(weight|bias)$", r"model.inner.q_head.\1"),
    (r"^h_init$", "model.inner.H_init"),
    (r"^l_init$", "model.inner.L_init"),
    (r"^h_level\.blocks\.(\d+)\.", r"model.inner.H_level.layers.\1."),
    (r"^l_level\.blocks\.(\d+)\.", r"model.inner.L_level.layers.\1."),
    (r"\.attention\.qkv\.", ".self_attn.qkv_proj."),
    (r"\.attention\.out\.", ".self_attn.o_proj."),
    (r"\.mlp\.gate_up\.", ".mlp.gate_up_proj."),
    (r"\.mlp\.down\.", ".mlp.down_proj."),
]


def reference_name(ours: str) -> str:
    for pattern, replacement in NAMES:
        ours = re.sub(pattern, replacement, ours)
    assert ours.startswith("model.inner."), ours
    return ours


def exploration_draws(step: int, max_steps: int):
    """Our model's coins for a row (keyed by its sample id) as the reference's (rand_like, randint_like) draws."""

    def draws(data):
        key = (SEED, EXPLORATION, step)
        minimum = 2 + (keyed_uniform(*key, 1, data["ids"]) * (max_steps - 1)).long()
        return keyed_uniform(*key, 0, data["ids"]), minimum.to(torch.int32)

    return draws


def make_pair(positions: str, loss: str):
    torch.manual_seed(0)
    ours = HRM(VOCAB, SEQ, num_puzzle_ids=5, hidden=32, heads=4, expansion=2.0, h_layers=2, l_layers=2, h_cycles=2,
               l_cycles=3, halt_max_steps=MAX_STEPS, exploration_prob=0.5, positions=positions).double()
    with torch.no_grad():  # a Q head and an embedding table that matter (zero-initialised in both otherwise)
        ours.q_head.weight.normal_(0, 0.3)
        ours.q_head.bias.normal_(0, 0.5)
        ours.puzzle_emb.table.normal_(0, 1)
    config = SimpleNamespace(batch_size=ROWS, seq_len=SEQ, puzzle_emb_ndim=32, num_puzzle_identifiers=5,
                             vocab_size=VOCAB, H_cycles=2, L_cycles=3, H_layers=2, L_layers=2, hidden_size=32,
                             expansion=2.0, num_heads=4, pos_encodings=positions, rms_norm_eps=1e-5,
                             rope_theta=10000.0, halt_max_steps=MAX_STEPS, halt_exploration_prob=0.5)
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)  # the transcription's tensors are float64 from the start (as forward_dtype)
    try:
        reference = ACTLossHead(ACT(config, exploration_draws(1, MAX_STEPS)), loss_type=f"{loss}_cross_entropy")
    finally:
        torch.set_default_dtype(default)
    reference.load_state_dict({reference_name(k): v for k, v in ours.state_dict().items()}, strict=True)
    return ours, reference


def make_batch(segment: int) -> dict:
    generator = torch.Generator().manual_seed(100 + segment)
    labels = torch.randint(2, VOCAB, (ROWS, SEQ), generator=generator)
    labels[0, :3] = IGNORE_LABEL_ID  # a few unlabelled cells
    inputs = torch.where(torch.rand(ROWS, SEQ, generator=generator) < 0.4, 1, labels.clamp_min(0))
    return {"inputs": inputs, "labels": labels, "puzzle_ids": torch.randint(0, 5, (ROWS,), generator=generator),
            "ids": torch.arange(segment * ROWS, (segment + 1) * ROWS)}


def as_reference(batch: dict) -> dict:
    return {"inputs": batch["inputs"].to(torch.int32), "labels": batch["labels"].to(torch.int32),
            "puzzle_identifiers": batch["puzzle_ids"].to(torch.int32), "ids": batch["ids"]}


def close(a, b, what, rtol=1e-9):
    assert a is not None and b is not None, (what, "missing on one side")
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert torch.allclose(a, b, rtol=rtol, atol=1e-12), (what, (a - b).abs().max().item())


@pytest.mark.parametrize("positions, loss", [("rope", "stablemax"), ("learned", "softmax")])
def test_training_segments_match_the_reference(positions, loss):
    ours, reference = make_pair(positions, loss)
    ours.train()
    reference.train()
    ours_params = dict(ours.named_parameters())
    reference_params = dict(reference.named_parameters())
    assert {reference_name(k) for k in ours_params} == set(reference_params)
    embedding_step = SparseSignSGD(ours.puzzle_emb, lr=0.01, weight_decay=0.1)
    ours_carry = ours.initial_carry(make_batch(0))
    reference_carry = reference.model.initial_carry(as_reference(make_batch(0)))
    halted_seen, replaced, longest = [], 0, 0
    for segment in range(SEGMENTS):
        data, step = make_batch(segment), segment + 1
        out = ours(ours_carry, data, explore_key=(SEED, EXPLORATION, step))
        ours_loss, sums = act_losses(out, loss)
        reference.model.exploration_draws = exploration_draws(step, MAX_STEPS)
        reference_carry, reference_loss, metrics, ref_out, _ = reference(carry=reference_carry,
                                                                         batch=as_reference(data))
        # What each side decided: the same rows halted, after the same number of segments, on the same puzzles.
        assert out["halted"].tolist() == reference_carry.halted.tolist(), segment
        assert out["steps"].tolist() == reference_carry.steps.tolist(), segment
        assert out["carry"]["data_ids"].tolist() == reference_carry.current_data["ids"].tolist(), segment
        halted_seen.append(out["halted"].tolist())
        replaced += int((out["steps"] == 1).sum()) if segment else 0
        longest = max(longest, int(out["steps"].max()))
        close(out["logits"], ref_out["logits"], "logits")
        close(out["q_halt"], ref_out["q_halt_logits"], "q_halt")
        close(out["q_continue"], ref_out["q_continue_logits"], "q_continue")
        close(out["target_q_continue"], ref_out["target_q_continue"], "target_q_continue")
        close(out["carry"]["z_h"], reference_carry.inner_carry.z_H, "z_H")
        close(out["carry"]["z_l"], reference_carry.inner_carry.z_L, "z_L")
        close(ours_loss, reference_loss, "loss")
        for ours_name, reference_metric in [("count", "count"), ("token_correct", "accuracy"),
                                            ("exact_correct", "exact_accuracy"),
                                            ("q_halt_correct", "q_halt_accuracy"), ("segments", "steps"),
                                            ("lm_loss", "lm_loss"), ("q_halt_loss", "q_halt_loss"),
                                            ("q_continue_loss", "q_continue_loss")]:
            # The reference sums the token accuracy in float32 (cell by cell): equal to float32 rounding.
            close(sums[ours_name], metrics[reference_metric].double(), reference_metric,
                  rtol=1e-6 if reference_metric == "accuracy" else 1e-9)
        # The same gradients: every weight, and the puzzle-embedding rows of the batch.
        ours_loss.backward()
        reference_loss.backward()
        for name, param in ours_params.items():
            close(param.grad, reference_params[reference_name(name)].grad, f"grad {name}")
        local = reference.model.inner.puzzle_emb
        close(ours.puzzle_emb.batch_rows.grad, local.local_weights.grad, "grad puzzle embedding rows")
        assert torch.equal(ours.puzzle_emb.batch_ids, local.local_ids.long())
        # One step of training on both sides, so the next segment runs on changed weights.
        with torch.no_grad():
            for name, param in ours_params.items():
                param -= 0.05 * param.grad
                reference_params[reference_name(name)] -= 0.05 * reference_params[reference_name(name)].grad
                param.grad = reference_params[reference_name(name)].grad = None
        embedding_step.step()
        embedding_step.zero_grad()
        sparse_emb_signsgd(local.local_weights.grad, local.local_ids, local.weights, lr=0.01, weight_decay=0.1)
        local.local_weights.grad = None
        close(ours.puzzle_emb.table, local.weights, "puzzle embedding table")
        ours_carry = out["carry"]
    # Not a trivial case: some rows halted and took new puzzles, others went on thinking for several segments.
    flat = [flag for row in halted_seen for flag in row]
    assert any(flat) and not all(flat) and replaced > 0 and longest >= 3, (halted_seen, replaced, longest)


def test_evaluation_segments_match_the_reference():
    ours, reference = make_pair("rope", "stablemax")
    ours.eval()
    reference.eval()
    data = make_batch(0)
    ours_carry, reference_carry = ours.initial_carry(data), reference.model.initial_carry(as_reference(data))
    with torch.no_grad():
        for segment in range(MAX_STEPS):
            out = ours(ours_carry, data)
            loss, sums = act_losses(out)
            reference_carry, reference_loss, metrics, ref_out, all_finish = reference(carry=reference_carry,
                                                                                      batch=as_reference(data))
            assert out["halted"].tolist() == reference_carry.halted.tolist() == [segment == MAX_STEPS - 1] * ROWS
            assert bool(all_finish) == (segment == MAX_STEPS - 1)
            close(out["logits"], ref_out["logits"], "logits")
            close(out["q_halt"], ref_out["q_halt_logits"], "q_halt")
            close(loss, reference_loss, "loss")
            close(sums["exact_correct"], metrics["exact_accuracy"].double(), "exact_accuracy")
            ours_carry = out["carry"]
