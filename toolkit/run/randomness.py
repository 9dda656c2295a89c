"""Randomness keyed by what it belongs to, so results do not depend on the process count or on resuming.

Sample-level randomness (sampled negatives, per-sample coins such as HRM's exploration or DCRNN's teacher forcing)
is a counter-based hash of (seed, purpose, ..., sample id), computed for a whole batch at once in torch:
`keyed_hash`, `keyed_uniform`. It depends neither on the rank nor on the process count.

Dropout: `KeyedDropout` draws the mask of the whole GLOBAL micro-batch from a generator seeded by
(seed, micro-batch key, call number) and keeps this rank's rows of it, so a sample gets the same mask whichever
rank holds it: N processes match one process with dropout on, and a resumed run matches an uninterrupted one.
The loop announces each micro-batch with `begin_micro_batch`. Any other use of the global torch RNG is reseeded
from (seed, step, rank) before every micro-batch (`step_seed`): exact on resume, but rank-dependent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


def mix32(x):  # a tensor of int64, or a Python int
    # A well-tested 32-bit integer finaliser; products stay below 2**59, so int64 never overflows.
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def keyed_hash(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash integer keys (tensors broadcast together) to uniform 32-bit values, as int64, on the device of the
    tensor keys (a GPU tensor key wins over CPU ones; Python ints follow: a scalar key last must not bring the hash
    back to the CPU, as it once did for SASRec's negatives on a GPU)."""
    device = next((k.device for k in keys if isinstance(k, torch.Tensor) and k.device.type != "cpu"), "cpu")
    hashed = 0x9E3779B9  # a Python int until the first tensor key: scalar keys cost no kernel and no host-to-device
    for key in keys:     # copy (which a captured CUDA step cannot hold); the same arithmetic, bit for bit
        if isinstance(key, torch.Tensor):
            key = key.to(device=device, dtype=torch.int64)
        hashed = mix32(hashed ^ (key & MASK32) ^ ((key >> 32) & MASK32) * 0x27D4EB2F & MASK32)
    return hashed if isinstance(hashed, torch.Tensor) else torch.tensor(hashed, dtype=torch.int64, device=device)


def keyed_uniform(*keys: torch.Tensor | int) -> torch.Tensor:
    """Uniform floats in [0, 1) (float64), a pure function of the integer keys: per-sample coins that do not
    depend on the rank, e.g. keyed_uniform(seed, PURPOSE, step, sample_ids) < 0.1."""
    return keyed_hash(*keys).double() / 2.0**32


def keyed_hash_int(*keys: int) -> int:
    """keyed_hash on Python ints, bit for bit (the same operators; no int64 overflow: every product stays below
    2**62): for a few scalar keys it costs ~1 us where the tensor version costs ~90 us, once per micro-batch."""
    hashed = 0x9E3779B9
    for key in keys:
        hashed = mix32(hashed ^ (key & MASK32) ^ ((key >> 32) & MASK32) * 0x27D4EB2F & MASK32)
    return hashed


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for the global RNG before a micro-batch: draws from it depend on (seed, step, rank) only."""
    return keyed_hash_int(seed, 0x5EED, step, rank)


def reseed_global_rng(seed: int) -> None:
    """torch.manual_seed(seed) without its per-micro-batch cost on the CPU: torch.manual_seed also queues a lazy seed
    for CUDA, XPU and MTIA, each capturing a stack trace (~90 us) even when none of them is ever used. The same
    generators end up seeded: the CPU's, and CUDA's when this process has started it (a GPU run's model is on the
    device before the first micro-batch)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@dataclass
class _MicroBatch:
    seed: int
    key: int
    rank: int
    world_size: int
    calls: int = 0


_current: _MicroBatch | None = None


def begin_micro_batch(seed: int, key: int, rank: int, world_size: int) -> None:
    """Called by the loop before each micro-batch: the key (epoch, batch) that KeyedDropout masks derive from."""
    global _current
    _current = _MicroBatch(seed, key, rank, world_size)


def end_micro_batches() -> None:
    global _current
    _current = None


def keyed_keep(rows: int, per_row: int, p: float, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor | None:
    """The keep mask of keyed dropout for `rows` samples of `per_row` elements each: [rows, per_row], `scale` where
    kept, 0 where dropped, the same for a sample on any rank and any process count. None outside a loop's
    micro-batch (no key announced). Each call in a micro-batch draws a new mask (the call number is in the seed).

    The random numbers of the global micro-batch [world_size * rows, per_row] are drawn from a generator seeded by
    (seed, key, call number) and this rank's rows [rank * rows, (rank + 1) * rows) are kept: the rows a rank holds
    under split batches. 16 random bits per element, four from each 64-bit draw: half the generator's work of one
    float draw per element (the masks' random numbers were 13% of SASRec's step at maxlen 200); keep_from_lanes
    turns them into the mask.
    """
    if _current is None:
        return None
    state = _current
    state.calls += 1
    generator = _keyed_generator(torch.device(device), state.calls)
    if not _capturing(generator.device):  # captured (--cuda-graphs): seeded before each replay instead
        generator.manual_seed(keyed_hash_int(state.seed, 0xD509, state.key, state.calls))
    count = rows * state.world_size * per_row
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), 2**63 - 1, generator=generator)
    # (a view of the words, used here only: a function returning it would return an int16 alias of an int64
    # tensor, which torch.compile's aot_autograd cannot rebuild after the graph break at the generator)
    lanes = words.view(torch.int16)[:count].view(rows * state.world_size, per_row)
    keep = lanes[state.rank * rows:(state.rank + 1) * rows]  # this rank's rows (the lanes of its samples)
    return keep_from_lanes(keep, p, dtype, scale)


# One generator per (device, draw number in the micro-batch), reseeded for each draw: the same numbers as a new
# generator seeded alike, and the same generator objects every step, which a captured step (toolkit.run.step_graph)
# registers with its CUDA graph and reseeds before each replay.
_generators: dict[tuple[str, int], torch.Generator] = {}


def _keyed_generator(device: torch.device, call: int) -> torch.Generator:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    where = str(device)
    generator = _generators.get((where, call))
    if generator is None:
        generator = _generators[(where, call)] = torch.Generator(device=where)
    return generator


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keyed_generators() -> list[torch.Generator]:
    """KeyedDropout's CUDA generators made so far (a captured step registers them with its graph)."""
    return [g for g in _generators.values() if g.device.type == "cuda"]


def keyed_calls() -> int:
    """KeyedDropout draws so far in the current micro-batch."""
    return 0 if _current is None else _current.calls


def rewind_keyed_calls(calls: int) -> None:
    """The current micro-batch's draws back to `calls` (a capture that failed made draws that never ran)."""
    if _current is not None:
        _current.calls = calls


def reseed_keyed_generators(calls: int) -> None:
    """Before a captured step's replay: seed the generators of its `calls` draws for the current micro-batch, as
    keyed_keep seeds them when the step runs uncaptured."""
    if _current is None or not calls:
        return
    for (_, call), generator in _generators.items():
        if call <= calls and generator.device.type == "cuda":
            generator.manual_seed(keyed_hash_int(_current.seed, 0xD509, _current.key, call))


def keep_from_lanes(lanes: torch.Tensor, p: float, dtype: torch.dtype = torch.float32,
                    scale: float = 1.0) -> torch.Tensor:
    """The keep mask of keyed dropout from its random numbers (int16 lanes, uniform over [-32768, 32767]): `scale`
    where kept, 0 where dropped; an element is dropped with probability round(p * 65536) / 65536 (p = 0.2:
    0.19999695). A new tensor, contiguous."""
    threshold = round(p * 65536) - 32768  # kept: lane >= threshold
    if lanes.device.type == "cpu" and dtype in (torch.float32, torch.float64):
        # The same 0/1 by arithmetic on the integers (exact in float): int16 -> float, - (threshold - 1), clamp to
        # [0, 1]. On the CPU 0.8 ms for 2.56M elements, where the comparison and its bool -> float copy took 1.7 ms.
        keep = lanes.to(dtype).sub_(threshold - 1).clamp_(0.0, 1.0)
    else:  # two kernels (a GPU counts launches). Not bool viewed as uint8: inductor cannot lower that view on CUDA
        keep = (lanes >= threshold).to(dtype)
    return keep if scale == 1.0 else keep.mul_(scale)


def keyed_keep_mask(shape: tuple[int, ...], p: float, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """keyed_keep for a tensor of this shape (dim 0 = batch): 1 where kept, 0 where dropped, in the tensor's shape."""
    keep = keyed_keep(shape[0], math.prod(shape[1:]), p, device=device, dtype=dtype)
    return None if keep is None else keep.view(shape)


def keyed_dropout(x: torch.Tensor, p: float, training: bool = True, batch_dim: int = 0) -> torch.Tensor:
    """Dropout whose mask for a sample is the same on any rank and any process count (see keyed_keep_mask; the
    samples lie along `batch_dim`). Outside a loop's micro-batch it is plain dropout."""
    if not training or p == 0.0:
        return x
    batch_dim = batch_dim % x.dim()
    shape = (x.shape[batch_dim], *x.shape[:batch_dim], *x.shape[batch_dim + 1:])  # the batch first
    keep = keyed_keep_mask(shape, p, device=x.device, dtype=x.dtype)
    if keep is None:
        return torch.nn.functional.dropout(x, p, training=True)
    # The 1 / (1 - p) scale goes into the mask in place: one multiplication of x forward, one backward.
    return x * keep.mul_(1.0 / (1.0 - p)).movedim(0, batch_dim)


class KeyedDropout(torch.nn.Module):
    """nn.Dropout with rank-free masks (see keyed_dropout). batch_dim is where the samples lie, given explicitly: a
    mask keyed by the wrong dimension (a sequence-first GRU's time) differs between 1 and N processes (0.15 after a
    few steps) without a word."""

    def __init__(self, p: float = 0.5, *, batch_dim: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.batch_dim = p, batch_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(x, self.p, self.training, self.batch_dim)

    def extra_repr(self) -> str:
        return f"p={self.p}, batch_dim={self.batch_dim}"


RANK_DEPENDENT_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                          torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
# Modules whose dropout is a number inside them, not a submodule: nn.GRU/LSTM/RNN between layers, and the attention
# weights' dropout of nn.MultiheadAttention (in every nn.Transformer* layer).
INTERNAL_DROPOUT = (torch.nn.RNNBase, torch.nn.MultiheadAttention)


def rank_dependent_dropout(model: torch.nn.Module) -> list[str]:
    """The names of the model's torch dropout with p > 0, modules and the internal dropout of nn.GRU, nn.LSTM, nn.RNN
    and nn.MultiheadAttention (nn.Transformer*): their masks come from each rank's own generator, so N processes do
    not train as one process (0.022 max weight difference after 5 steps, against 1.5e-7 with KeyedDropout; a GRU's
    dropout=0.2, 0.055)."""
    names = []
    for name, module in model.named_modules():
        shown = name or type(module).__name__
        if isinstance(module, RANK_DEPENDENT_DROPOUT) and module.p > 0:
            names.append(shown)
        elif isinstance(module, INTERNAL_DROPOUT) and module.dropout > 0:
            names.append(f"{shown} ({type(module).__name__}'s dropout={module.dropout:g})")
    return names


def rank_dependent_dropout_line(model: torch.nn.Module) -> str | None:
    """One line for the start of a run whose model has torch dropout, or None."""
    names = rank_dependent_dropout(model)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"warning: the model uses torch.nn dropout ({shown}): its masks differ by rank, so N processes do not "
            "train as one and a resume on another process count differs; use toolkit.KeyedDropout (for a GRU, "
            "LSTM, RNN or attention: dropout=0 inside, KeyedDropout between)")


class UntouchedItems:
    """Negatives for sequential recommendation: per (user, position), one item the user never touched, drawn
    uniformly from that user's untouched items, as a pure function of (seed, purpose, epoch, user, position).

    Built once from `touched` (bool [num_users, num_items + 1], column 0 the padding item): each user's untouched items
    in one table row, so a draw is one keyed hash and one gather, vectorised over the batch, with no data-dependent
    branch and nothing read on the host (the rejection loop it replaces read `pending.any()` on the host after every
    attempt: a sync per attempt on a GPU). The table is int32 [num_users, most untouched items]."""

    def __init__(self, touched: torch.Tensor):
        untouched = ~touched.bool()
        untouched[:, 0] = False  # the padding item is never a negative
        self.counts = untouched.sum(dim=1)
        if bool((self.counts == 0).any()):  # once, at construction
            user = int(torch.nonzero(self.counts == 0)[0, 0])
            raise ValueError(f"user {user} touched every item: no negative can be drawn for them")
        # Stable sort of "touched" (False first): each row starts with its untouched items in increasing order.
        order = torch.sort((~untouched).to(torch.uint8), dim=1, stable=True).indices
        self.table = order[:, : int(self.counts.max())].to(torch.int32)

    def sample(self, users: torch.Tensor, positions: torch.Tensor, *, seed: int, purpose: int,
               epoch: int | torch.Tensor) -> torch.Tensor:
        """int64 [B, P]: users [B] (on the table's device), positions [P]; the epoch an int or a 0-d int64 tensor
        (the same draws; a captured step needs the tensor)."""
        users = users.view(-1, 1)
        positions = positions.view(1, -1).to(users.device)
        rank = keyed_hash(seed, purpose, epoch, users, positions) % self.counts[users]
        return self.table[users, rank].long()


def sample_negatives(touched: torch.Tensor, users: torch.Tensor, positions: torch.Tensor, *, seed: int, purpose: int,
                     epoch: int) -> torch.Tensor:
    """UntouchedItems(touched).sample(...): for a one-off draw (a sampler used every step is built once)."""
    return UntouchedItems(touched).sample(users, positions, seed=seed, purpose=purpose, epoch=epoch)
