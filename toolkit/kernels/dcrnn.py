"""DCRNN's fast paths: toolkit/models/dcrnn.py's DCRNN as a fused sequence kernel, and its GraphDiffusion with the
product's layout and backward written out.

Swapped in by toolkit.kernels when a run builds the model (`--kernels auto`), and proven equal to the model file's
code at every start; each takes its fast path where it applies and the model's own code (`super()`) everywhere else.

GraphDiffusion (every sequence kernel): x and all its diffused copies as one product of the stacked [I; T_k(S)] with
x, laid out as the linear maps' input, as one autograd Function with its backward written out (_DiffuseFlat): the
transposed operator is kept, sparse where the model file's is, so the backward does not transpose on every call,
and the product and its layout copy are one autograd node each way. The same products as the model file's, but for
sparse ones under CPU autocast (GraphDiffusion below).

DCRNN: two sequence kernels compute the model (DCRNN(sequence_kernel=...); the recipe's --sequence-kernel): the
cells (the model file's forward, a DCGRUCell step at a time under autograd), and the fused kernel (fused_forward). On
a GPU the kernel launches of a step are what limit this model: the cells launch ~3,000 per optimizer step of the
recipe, most of them autograd's for 48 small cell steps. The fused kernel is one autograd Function over the whole
sequence with a hand-written backward (_FusedDCRNN), ~930:

- the rows are batch-major (sample, node), and the stacking puts the matrix index inside the node's, so the
  diffusion [(sample, node, m), feature] of a [(sample, node), feature] block IS the linear maps' input
  [(sample, node), (m, feature)]: one sparse (or batched dense) product, no layout copy;
- every state lives in one buffer R [rows, B * N, width], a row holding [input | h^0 | h^1 | ...] blocks each with a
  trailing column of ones (the biases are weight rows, at m = 0 where T_0 = I keeps ones ones), skewed so that the
  cell of layer l at time t reads ONE window, row t + l, blocks l and l + 1 = [h^{l-1}_t | h^l_{t-1}], and writes
  h^l_t where its two readers look for it: no concatenation and no copy per step;
- a cell step is 9 kernels forward (the window's diffusion, one product for the reset/update gates and the
  candidate's input part, sigmoid, reset * state, its diffusion, the candidate's product, tanh, the state update in
  two) and 11 backward (the derivatives written side by side into one buffer, the same products transposed, the
  gradients accumulated in place into a gradient buffer laid out as R); the weight gradients of all the steps are a
  few products at the end, not one per step per weight;
- the encoder has no feedback, so its layers run as a wavefront: at step s layer l computes time s - l, all layers
  in the same kernels (one window, block-banded weights), 12 + L - 1 steps instead of 12 L. The cells before a
  layer's first step and after its last are computed and harmless: the first get an update gate of exactly 1 (their
  state stays exactly 0, and every gradient they pass on is exactly 0), the last touch only rows no real cell reads;
- the decoder (its prediction fed back: no wavefront) runs cell by cell, 12 L steps; the fed-back value is one
  batched product a step (the true value where the coin came up, else the projection), the predictions one product;
- all the parameters are packed into the fused layout by one gather a forward (index maps built once) and their
  gradients unpacked by one gather; the run's buffers come from a pool kept with the model (new pages every step
  cost more than the products on CPU).
The price: the wavefront's banded weights and the candidate's zero block are products with zeros, and each window is
diffused whole (each state twice): on CPU, where launches cost nothing, a step of the cpu preset's model is ~1.2x the
cells' (benchmarks/README.md), so sequence_kernel="auto" takes the fused kernel on CUDA only. On CPU in float32 /
float64 its diffusion operators are sparse CSR tensors (block-diagonal over the samples) when few enough entries are
non-zero (FUSED_SPARSE_DENSITY); otherwise dense, expanded over the samples for bmm. Under autocast its products run
in the autocast dtype, the states and their gradients in the parameters' dtype. torch.compile traces the cells.

The fused kernel's state (its layout and index maps, its operators, its buffers) is derived from the model's sizes
and made at its first forward: the swap adds no parameters or buffers, and a checkpoint cannot tell.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict

import torch

from toolkit.kernels import replaces
from toolkit.models import dcrnn
from toolkit.models.dcrnn import operator_product

# The fused sequence kernel's operators are sparse on CPU below this fraction of non-zeros (CSR, block-diagonal over
# the samples; dense ones are batched products). Measured (one thread, batch 64, a 36-column window's diffusion; the
# sparse time grows with the non-zeros, the dense one does not): 50 nodes, 5% non-zeros CSR 0.16 ms, dense 0.72 ms;
# 24%: 0.49, 0.73; 37%: 0.74, 0.69; 207 nodes, 1%: 0.8, 12.6; 19%: 7.3, 12.6; 34%: 12.9, 12.5. They cross near 35%.
FUSED_SPARSE_DENSITY = 0.3
_CACHED_OPERATORS = 16  # fused operators kept, (device, dtype, kind, blocks): train, eval and the backward's counts


class _DiffuseFlat(torch.autograd.Function):
    """x [N, B, F] -> [N * B, M * F]: the stacked [I; T_k(S)] times x, laid out as a linear map's input (features
    ordered (matrix, feature)). One autograd node for the product and its layout copy, in both directions: each
    cell step diffuses twice, and the Python and autograd cost of the separate views, permutes and copies was a
    visible share of the step. The matrices are constants (no gradient); the transposed one is kept, as a coalesced
    sparse tensor where sparse, so the backward pass does not transpose on every call."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, matrix: torch.Tensor, transposed: torch.Tensor) -> torch.Tensor:
        nodes, batch, features = x.shape
        matrices = matrix.shape[0] // nodes
        ctx.transposed, ctx.shape = transposed, (matrices, nodes, batch, features)
        product = operator_product(matrix, x.reshape(nodes, batch * features))
        return product.view(matrices, nodes, batch, features).permute(1, 2, 0, 3).reshape(nodes * batch, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        matrices, nodes, batch, features = ctx.shape
        grad = grad.view(nodes, batch, matrices, features).permute(2, 0, 1, 3).reshape(matrices * nodes, -1)
        grad = grad.to(ctx.transposed.dtype)  # under autocast the product's output, so its grad, may be half
        return operator_product(ctx.transposed, grad).view(nodes, batch, features), None, None


@replaces(dcrnn.GraphDiffusion)
class GraphDiffusion(dcrnn.GraphDiffusion):
    """The model file's diffusion as one autograd Function, its backward written out (_DiffuseFlat): the same
    products, the transposed operator kept. (Under CPU autocast a sparse product runs in the autocast dtype here, in
    x's dtype in the model file, whose autograd cannot take the low-precision one's backward.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DiffuseFlat.apply(x, *self.operator(x))


# ---- the fused sequence kernel's diffusion operators -------------------------------------------------------------


class _Operators:
    """The fused kernel's operators of one GraphDiffusion (kept on it, made at the first fused forward): the density
    of its stacked matrices, read once, and (device, dtype, kind, blocks, buffer) -> operator, least recently used
    first out. Each is built once (a conversion and, sparse, an index construction): a training step uses 4
    (per-step products forward and backward, the weight gradients' of the encoder and of the decoder), evaluation 1."""

    def __init__(self, diffusion: dcrnn.GraphDiffusion):
        self.density = float((diffusion.stacked != 0).double().mean())
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def fused_operators(diffusion: dcrnn.GraphDiffusion) -> _Operators:
    """The fused kernel's operators of `diffusion` (a plain attribute of the module: no parameter, no buffer)."""
    operators = diffusion.__dict__.get("_fused_operators")
    if operators is None:
        operators = diffusion.__dict__["_fused_operators"] = _Operators(diffusion)
    return operators


def fused_sparse(diffusion: dcrnn.GraphDiffusion, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fused_operator() is sparse there: on CPU in float32 / float64 on a sparse enough graph (CUDA's dense
    products are fast at these sizes, and half precision has no CPU sparse kernel)."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
            and fused_operators(diffusion).density < FUSED_SPARSE_DENSITY)


def fused_matrix(diffusion: dcrnn.GraphDiffusion, kind: str) -> torch.Tensor:
    """The diffusion's matrices T_m, m = 0..M-1 (T_0 = I, then T_k(S) for every support S and step k = 1..K,
    support-major; T[m, n, n'] the entry of T_m by which node n gathers from node n') in a layout of the fused kernel:
    - "spread" [(n, m), n']: with the matrix index inside the node's, on the fused kernel's batch-major rows
      (sample, node) its output [(b, n, m), F] IS the linear maps' input [(b, n), (m, F)], no copy;
    - "collect" [n', (n, m)], its transpose: the backward of "spread"."""
    m, n = diffusion.matrices, diffusion.nodes
    t = diffusion.stacked.view(m, n, n)
    if kind == "spread":
        return t.permute(1, 0, 2).reshape(n * m, n)
    if kind == "collect":
        return t.permute(2, 1, 0).reshape(n, n * m)
    raise ValueError(f"unknown diffusion operator kind {kind!r}")


def _block_diagonal_csr(matrix: torch.Tensor, blocks: int) -> torch.Tensor:
    """`blocks` copies of `matrix` down the diagonal, as a sparse CSR tensor (the batch-major products' operator)."""
    rows, cols = matrix.shape
    row, col = matrix.nonzero(as_tuple=True)  # row-major, so the block-major repetition below is CSR order
    values = matrix[row, col]
    shift = torch.arange(blocks, device=matrix.device)[:, None]
    row, col = (row + shift * rows).reshape(-1), (col + shift * cols).reshape(-1)
    crow = torch.zeros(blocks * rows + 1, dtype=torch.int64, device=matrix.device)
    crow[1:] = torch.bincount(row, minlength=blocks * rows).cumsum(0)
    if max(blocks * rows, blocks * cols, len(col)) < 2**31:  # MKL's (LP64) index type: no conversion per product
        crow, col = crow.int(), col.int()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta state")
        return torch.sparse_csr_tensor(crow, col, values.repeat(blocks), (blocks * rows, blocks * cols),
                                       check_invariants=False)


def fused_operator(diffusion: dcrnn.GraphDiffusion, kind: str, device: torch.device, dtype: torch.dtype,
                   blocks: int = 1) -> torch.Tensor:
    """The fused kernel's "spread" or "collect" operator (fused_matrix) for `blocks` samples. Sparse (CPU,
    float32/64, density < FUSED_SPARSE_DENSITY): a CSR tensor of `blocks` copies down the diagonal (one per sample);
    dense: the matrix itself, which the caller expands over the samples for bmm."""
    sparse, cache = fused_sparse(diffusion, device, dtype), fused_operators(diffusion).cache
    key = (torch.device(device), dtype, kind, blocks if sparse else 1, diffusion.stacked.data_ptr(),
           diffusion.stacked.device)
    operator = cache.get(key)
    if operator is not None and operator.is_inference() and not torch.is_inference_mode_enabled():
        operator = None  # made under inference_mode: not usable outside it
    if operator is None:
        matrix = fused_matrix(diffusion, kind).to(device=device, dtype=dtype)
        operator = _block_diagonal_csr(matrix, blocks) if sparse else matrix.contiguous()
        cache[key] = operator
        while len(cache) > _CACHED_OPERATORS:  # other batch sizes, or the model moved: oldest out
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return operator


def _diffuse(operator: torch.Tensor, rhs: torch.Tensor, *, add: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """operator (one block) times rhs [blocks * the operator's columns, F] -> [blocks * its rows, F]: one sparse
    product with the block-diagonal CSR operator, or one bmm with the dense one expanded over the blocks (no copy).
    out: the result's buffer; add: a [blocks * rows, F] tensor (any strides) the product is added to, in place."""
    rows, cols = operator.shape
    if operator.layout == torch.sparse_csr:
        if add is not None:
            if add.dtype == rhs.dtype:
                return add.addmm_(operator, rhs)
            return add.add_(torch.mm(operator, rhs))
        if out is None:
            return torch.mm(operator, rhs)
        return out.addmm_(operator, rhs, beta=0)  # not mm(out=): that zero-fills a new tensor of out's size first
    blocks, features = rhs.shape[0] // cols, rhs.shape[1]
    expanded, rhs = operator.expand(blocks, rows, cols), rhs.view(blocks, cols, features)
    if add is not None:
        if add.dtype == rhs.dtype:
            return add.view(blocks, rows, features).baddbmm_(expanded, rhs)
        return add.add_(torch.bmm(expanded, rhs).view(-1, features))
    if out is None:
        return torch.bmm(expanded, rhs).view(-1, features)
    torch.bmm(expanded, rhs, out=out.view(blocks, rows, features))
    return out


# ---- the fused sequence kernel -------------------------------------------------------------------------------------


def fused_parameters(model: dcrnn.DCRNN) -> list[torch.Tensor]:
    """The parameters the fused kernel packs, in its order: per cell (encoder layers, then decoder layers) the gates'
    weight and bias and the candidate's, then the projection's weight and bias."""
    params = []
    for cell in [*model.encoder, *model.decoder]:
        params += [cell.gates.linear.weight, cell.gates.linear.bias]
        params += [cell.candidate.linear.weight, cell.candidate.linear.bias]
    return [*params, model.projection.weight, model.projection.bias]


class _State:
    """The fused kernel's state of one model, derived from its sizes (kept on it, made at its first fused forward;
    not saved): the layout, its index maps and the packed weights' zero on each device and dtype the model has run
    in, the CPU output buffers reused between steps (_Run.scratch) and the pool of released buffers (_Run.acquire).
    Its tensors are made outside inference_mode, so that a first forward there leaves them usable for training."""

    def __init__(self, model: dcrnn.DCRNN):
        self.layout = _Layout(model.units, len(model.encoder), model.diffusion.matrices,
                              model.encoder[0].in_features, model.output_dim, model.horizon)
        with torch.inference_mode(False):
            self.indices = {torch.device("cpu"): self.layout.build_indices(
                [p.shape for p in fused_parameters(model)])}
        self.zeros: dict[tuple, torch.Tensor] = {}
        self.scratch: dict[tuple, torch.Tensor] = {}
        self.pool: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.indices.get(device)
        if indices is None:
            with torch.inference_mode(False):
                pack, unpack = self.indices[torch.device("cpu")]
                indices = self.indices[device] = (pack.to(device), unpack.to(device))
        return indices

    def pack(self, device: torch.device) -> torch.Tensor:
        """packed = flat[pack], flat = the parameters flattened and concatenated, then a zero (_Layout)."""
        return self._indices(device)[0]

    def unpack(self, device: torch.device) -> torch.Tensor:
        """flat_grad = packed_grad[unpack]."""
        return self._indices(device)[1]

    def zero(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[1] zero: the packed weights' zero entries."""
        zero = self.zeros.get((device, dtype))
        if zero is None:
            with torch.inference_mode(False):
                zero = self.zeros[device, dtype] = torch.zeros(1, dtype=dtype, device=device)
        return zero


def _state(model: dcrnn.DCRNN) -> _State:
    """The fused kernel's state of `model` (a plain attribute of the module: no parameter, no buffer)."""
    state = model.__dict__.get("_fused_state")
    if state is None:
        state = model.__dict__["_fused_state"] = _State(model)
    return state


class _Layout:
    """Where the fused forward keeps things (see the module docstring).

    R's row: block 0 (width first = max(input_dim, output_dim) + 1: the encoder's input or the decoder's fed-back
    value, then a column of ones) and blocks 1..L (width block = units + 1: h^{j-1}, then ones); block j starts at
    offsets[j]. A band of k layers lo..lo+k-1 reads the window offsets[lo]:offsets[lo + k] + units (blocks lo..lo+k,
    the last one's state only); the diffusion of the window, [(sample, node), (matrix m, window column)], times the
    band's weights gives, for the k layers, the gates (2 units: reset, then update) of all k layers, then the
    candidate's input part (units) of all k layers.

    The packed weights, per segment (enc: one band of all L layers; dec0, dec1, ...: one band per layer; proj):
    - band [M window, 3 k units]: the gates' input, state and bias rows, the candidate's input and bias rows; a bias
      sits on its block's ones row at m = 0 (T_0 = I: the only matrix under which a column of ones stays ones);
    - state [M k units, k units], block-diagonal: the candidate's rows for the diffused reset * state;
    - proj [units + 1, output_dim]: the projection and its bias.
    The weight gradients come out in the same layouts, except the encoder's: per layer (the band's blocks between
    layers are zeros, ~40% of its products), a k = 1 band split into the gates' and the candidate's columns."""

    def __init__(self, units: int, layers: int, matrices: int, in_dim: int, out_dim: int, horizon: int):
        self.units, self.layers, self.matrices, self.in_dim, self.out_dim = units, layers, matrices, in_dim, out_dim
        self.horizon = horizon
        self.first, self.block = max(in_dim, out_dim) + 1, units + 1
        self.offsets = [0] + [self.first + j * self.block for j in range(layers + 1)]
        self.width = self.offsets[-1]
        self.segments: dict[str, tuple[int, tuple[int, int]]] = {}  # name -> (offset, shape), packed weights
        self.grad_segments: dict[str, tuple[int, tuple[int, int]]] = {}  # the same, their gradients
        self.size = self.grad_size = 0

    def window(self, lo: int, k: int) -> tuple[int, int]:
        return self.offsets[lo], self.offsets[lo + k] + self.units

    def build_indices(self, parameter_shapes: list[torch.Size]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pack, unpack): packed = flat[pack] with flat = the parameters flattened and concatenated, then a zero;
        flat_grad = packed_grad[unpack]. Parameters: per cell (encoder layers, then decoder layers) the gates' weight
        and bias and the candidate's, then the projection's weight and bias."""
        u, m, layers = self.units, self.matrices, self.layers
        sizes = [math.prod(shape) for shape in parameter_shapes]
        total = sum(sizes)
        ids = [part.view(shape) for part, shape in zip(torch.arange(total).split(sizes), parameter_shapes,
                                                        strict=True)]
        cells = [ids[4 * i: 4 * i + 4] for i in range(2 * layers)]
        packed, grads = [], []

        def add(name, segment, grad=False):
            segments, size, parts = (self.grad_segments, self.grad_size, grads) if grad else (self.segments,
                                                                                            self.size, packed)
            segments[name] = (size, (segment.shape[0], segment[0].numel()))
            parts.append(segment.reshape(-1))
            if grad:
                self.grad_size += segment.numel()
            else:
                self.size += segment.numel()

        def band(lo, cell_ids, features):
            k = len(cell_ids)
            start, end = self.window(lo, k)
            weights = torch.full((m, end - start, 3 * k * u), total)  # `total`: flat's zero
            state = torch.full((m, k * u, k * u), total)
            for j, ((gates_w, gates_b, cand_w, cand_b), f) in enumerate(zip(cell_ids, features, strict=True)):
                layer = lo + j
                x_rows, h_rows = self.offsets[layer] - start, self.offsets[layer + 1] - start
                ones = h_rows - 1
                gates_w, cand_w = gates_w.view(2 * u, m, f + u), cand_w.view(u, m, f + u)  # columns (m, feature)
                g, c = slice(2 * u * j, 2 * u * (j + 1)), slice(2 * u * k + u * j, 2 * u * k + u * (j + 1))
                weights[:, x_rows:x_rows + f, g] = gates_w[:, :, :f].permute(1, 2, 0)
                weights[:, h_rows:h_rows + u, g] = gates_w[:, :, f:].permute(1, 2, 0)
                weights[0, ones, g] = gates_b
                weights[:, x_rows:x_rows + f, c] = cand_w[:, :, :f].permute(1, 2, 0)
                weights[0, ones, c] = cand_b
                state[:, u * j:u * (j + 1), u * j:u * (j + 1)] = cand_w[:, :, f:].permute(1, 2, 0)
            return weights.reshape(-1, 3 * k * u), state.reshape(m * k * u, k * u)

        features = [self.in_dim] + [u] * (layers - 1)
        weights, state = band(0, cells[:layers], features)
        add("enc_band", weights)
        add("enc_state", state)
        for layer in range(layers):
            weights, state = band(layer, [cells[layer]], [features[layer]])
            add(f"enc{layer}_gates", weights[:, :2 * u], grad=True)
            add(f"enc{layer}_candidate", weights[:, 2 * u:], grad=True)
            add(f"enc{layer}_state", state, grad=True)
        for layer in range(layers):
            weights, state = band(layer, [cells[layers + layer]], [self.out_dim if layer == 0 else u])
            for grad in (False, True):
                add(f"dec{layer}_band", weights, grad)
                add(f"dec{layer}_state", state, grad)
        proj_w, proj_b = ids[-2], ids[-1]
        for grad in (False, True):
            add("proj", torch.cat([proj_w.T, proj_b[None]]), grad)
        pack, grad_ids = torch.cat(packed), torch.cat(grads)
        real = grad_ids < total
        unpack = torch.empty(total, dtype=torch.int64)
        unpack[grad_ids[real]] = torch.arange(len(grad_ids))[real]
        for entries in (pack, grad_ids):
            assert torch.equal(entries[entries < total].sort().values, torch.arange(total)), "each entry once"
        return pack, unpack

    def view(self, buffer: torch.Tensor, name: str, grad: bool = False) -> torch.Tensor:
        offset, shape = (self.grad_segments if grad else self.segments)[name]
        return buffer[offset:offset + shape[0] * shape[1]].view(shape)


class _Run:
    """One fused forward (and its backward): the buffers and the saved tensors of one sequence."""

    def __init__(self, model: DCRNN, x, teacher, use_teacher, params, compute_dtype):
        self.model, self.params = model, params
        self.state = state = _state(model)
        self.layout = state.layout
        self.x, self.dtype, self.compute = x, params[0].dtype, compute_dtype
        self.batch, self.steps, self.nodes = x.shape[0], x.shape[1], x.shape[2]
        self.rows = self.batch * self.nodes
        self.forcing = teacher is not None and use_teacher is not None
        self.coins, self.teacher = use_teacher, teacher  # without both: no coin comes up (forward())
        self.teacher_dtype = teacher.dtype if teacher is not None else None
        self.held: list[tuple[tuple, torch.Tensor]] = []

    def acquire(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised buffer this run keeps until release(): taken from the model's pool of released ones when
        one fits. The buffers of a run are tens of MB; new ones each step are new pages to fault in on CPU (a few ms
        a step on this 2-core VM), and allocator churn elsewhere."""
        dtype = self.compute if dtype is None else dtype
        key = (shape, dtype, self.x.device)
        try:
            buffer = self.state.pool[key].pop()
        except (KeyError, IndexError):
            buffer = torch.empty(shape, dtype=dtype, device=self.x.device)
        self.held.append((key, buffer))
        return buffer

    def release(self) -> None:
        """Back to the pool: a few per shape (the forwards of an accumulation window), the shapes of a few batch
        sizes (training's, evaluation's and their last batches'), least recently released first out."""
        pool = self.state.pool
        for key, buffer in self.held:
            free = pool.setdefault(key, [])
            pool.move_to_end(key)
            if len(free) < 4 and not buffer.is_inference():  # (made under inference_mode: read-only outside it)
                free.append(buffer)
        while len(pool) > 32:
            pool.popitem(last=False)
        self.held = []

    def operator(self, kind: str, blocks: int) -> torch.Tensor:
        return fused_operator(self.model.diffusion, kind, self.x.device, self.compute, blocks)

    def scratch(self, name: str, rows: int, columns: int) -> torch.Tensor | None:
        """A [rows, columns] output buffer for a product nothing keeps, reused from step to step on CPU: a fresh
        allocation of a few MB there is fresh pages, and their faults cost more than the product (measured: a 6 MB
        sparse product 0.9 ms into a reused buffer, 5-6 ms into a new one). None elsewhere (caching allocators)."""
        if self.x.device.type != "cpu":
            return None
        key, size = (name, threading.get_ident()), rows * columns  # (threads: DataParallel's replicas share it)
        buffer = self.state.scratch.get(key)
        if (buffer is None or buffer.numel() < size or buffer.dtype != self.compute
                or buffer.is_inference() and not torch.is_inference_mode_enabled()):
            buffer = self.state.scratch[key] = torch.empty(size, dtype=self.compute)
        return buffer[:size].view(rows, columns)

    def states(self, buffer: torch.Tensor, row: int, lo: int, k: int) -> torch.Tensor:
        """[B N, k, units]: the slots of h^{lo}..h^{lo+k-1} in `row` of R (or of its gradient)."""
        lay = self.layout
        return buffer[row, :, lay.first:].view(self.rows, lay.layers, lay.block)[:, lo:lo + k, :lay.units]

    def diagonal(self, buffer: torch.Tensor, first_row: int) -> torch.Tensor:
        """[L, B N, units]: h^l's slot of row first_row + l, for every l (the encoder-decoder handoff)."""
        lay, row = self.layout, buffer.stride(0)
        return buffer.as_strided((lay.layers, self.rows, lay.units), (row + lay.block, lay.width, 1),
                                 buffer.storage_offset() + first_row * row + lay.offsets[1])

    # ---- forward --------------------------------------------------------------------------------------------------
    def cell(self, buffer, row, lo, k, band, state, spread, reset_state, idle_from=None):
        """Layers lo..lo+k-1 at once, reading `row`'s window and writing their new states into row + 1: 9 kernels.
        idle_from: the layers from it on are before their first step (the encoder's wavefront): update gate 1."""
        lay, u, n, m = self.layout, self.layout.units, self.rows, self.layout.matrices
        start, end = lay.window(lo, k)
        window = buffer[row, :, start:end].to(self.compute)
        diffused = _diffuse(spread, window, out=self.scratch("diffused", n * m, end - start))
        pre = torch.mm(diffused.view(n, -1), band)  # [B N, 3 k u]: the gates, then the candidate's input part
        if idle_from is not None:
            pre[:, :2 * k * u].view(n, k, 2 * u)[:, idle_from:, u:].fill_(math.inf)
        gates = torch.sigmoid(pre[:, :2 * k * u])
        reset, update = gates.view(n, k, 2 * u).split(u, dim=-1)
        h_compute = window.as_strided((n, k, u), (window.stride(0), lay.block, 1),
                                      window.storage_offset() + lay.offsets[lo + 1] - start)
        torch.mul(reset, h_compute, out=reset_state.view(n, k, u))
        diffused = _diffuse(spread, reset_state, out=self.scratch("diffused reset", n * m, k * u))
        candidate = torch.tanh(torch.addmm(pre[:, 2 * k * u:], diffused.view(n, -1), state))
        h = self.states(buffer, row, lo, k)
        difference = h - candidate.view(n, k, u)
        torch.addcmul(candidate.view(n, k, u), update, difference, out=self.states(buffer, row + 1, lo, k))
        return gates, candidate, difference

    def forward(self) -> torch.Tensor:
        lay, state = self.layout, self.state
        u, layers, horizon, out_dim = lay.units, lay.layers, lay.horizon, lay.out_dim
        b, n, rows, steps = self.batch, self.nodes, self.rows, self.steps
        device, dtype, compute = self.x.device, self.dtype, self.compute
        self.span = span = steps + layers - 1  # wavefront steps of the encoder
        self.encoder_rows = steps + layers
        buffer = self.acquire(self.encoder_rows + horizon + layers, rows, lay.width, dtype=dtype).zero_()
        buffer[:, :, lay.first - 1::lay.block].fill_(1)  # the ones columns: the biases
        buffer[:steps, :, :lay.in_dim].view(steps, b, n, lay.in_dim).copy_(self.x.permute(1, 0, 2, 3))
        self.buffer = buffer
        encoder, decoder = buffer[:self.encoder_rows], buffer[self.encoder_rows:]
        flat = torch.cat([p.reshape(-1) for p in self.params] + [state.zero(device, dtype)])
        self.packed = packed = flat[state.pack(device)].to(compute)
        spread = self.operator("spread", b)

        self.reset_enc = self.acquire(span, rows, layers * u)
        band, state = lay.view(packed, "enc_band"), lay.view(packed, "enc_state")
        self.saved_enc = [
            self.cell(encoder, s, 0, layers, band, state, spread, self.reset_enc[s],
                      idle_from=s + 1 if s + 1 < layers else None)
            for s in range(span)
        ]
        self.diagonal(decoder, 0).copy_(self.diagonal(encoder, steps))  # the final states start the decoder

        # The value fed to the next decoder step, per sample: the true value where its coin came up, else the
        # prediction: teacher_fed + top @ proj_fed with teacher_fed = coin ? true value : 0 and proj_fed = coin ? 0 :
        # the projection (its bias row included), one batched product a step into R (no product, then a selection).
        if not self.forcing:  # the same computation with no coin up: evaluation gives what a run of zero coins does
            self.coins = torch.zeros(b, horizon, dtype=torch.bool, device=device)
            self.teacher = torch.zeros((), dtype=dtype, device=device).expand(b, horizon, n)
        proj = lay.view(packed, "proj")
        coins, zero = self.coins.T[:, :, None, None], torch.zeros((), dtype=compute, device=device)  # [T_out, B, 1, 1]
        self.proj_fed = proj_fed = torch.where(coins, zero, proj)  # [T_out, B, units + 1, output_dim]
        teacher_fed = torch.where(coins, self.teacher.permute(1, 0, 2)[..., None].to(compute), zero)  # [T_out, B, N, 1]
        self.reset_dec = self.acquire(layers, horizon, rows, u)
        self.saved_dec = [[None] * horizon for _ in range(layers)]
        bands = [(lay.view(packed, f"dec{i}_band"), lay.view(packed, f"dec{i}_state")) for i in range(layers)]
        top = slice(lay.offsets[layers], lay.offsets[layers + 1])
        for t in range(horizon):
            for i in range(layers):
                self.saved_dec[i][t] = self.cell(decoder, t + i, i, 1, *bands[i], spread, self.reset_dec[i, t])
            if t + 1 < horizon:
                fed = decoder[t + 1, :, :out_dim].view(b, n, out_dim)
                top_state = decoder[t + layers, :, top].to(compute).view(b, n, lay.block)
                if compute == dtype:
                    torch.baddbmm(teacher_fed[t], top_state, proj_fed[t], out=fed)
                else:
                    fed.copy_(torch.baddbmm(teacher_fed[t], top_state, proj_fed[t]))
        tops = decoder[layers:layers + horizon, :, top].view(horizon * rows, lay.block).to(compute)
        outputs = torch.mm(tops, proj)  # the predictions of all the steps at once
        return outputs.view(horizon, b, n, out_dim)[..., 0].permute(1, 0, 2)

    # ---- backward -------------------------------------------------------------------------------------------------
    def cell_backward(self, buffer, grads, row, lo, k, saved, band, state, collect, slot):
        """The gradients of cell(): 11 kernels. slot [B N, 3 k u]: the gates' and the candidate's pre-activation
        gradients, side by side (kept for the weight gradients); grads: R's gradient, accumulated in place."""
        lay, u, n = self.layout, self.layout.units, self.rows
        gates, candidate, difference = saved
        reset, update = gates.view(n, k, 2 * u).split(u, dim=-1)
        slot_gates = slot[:, :2 * k * u]
        slot_reset, slot_update = slot_gates.view(n, k, 2 * u).split(u, dim=-1)
        slot_candidate = slot[:, 2 * k * u:]
        grad_h = self.states(grads, row + 1, lo, k)
        grad_previous = self.states(grads, row, lo, k)
        # h' = candidate + update * (h - candidate)
        torch.ops.aten.tanh_backward.grad_input(torch.addcmul(grad_h, grad_h, update, value=-1),
                                                candidate.view(n, k, u), grad_input=slot_candidate.view(n, k, u))
        torch.mul(grad_h, difference, out=slot_update)
        grad_previous.addcmul_(grad_h, update)
        # candidate = tanh(input part + D(reset * h) state)
        grad_diffused = torch.mm(slot_candidate, state.T, out=self.scratch("grad diffused reset", n, state.shape[0]))
        grad_reset_state = _diffuse(collect, grad_diffused.view(-1, k * u)).view(n, k, u)
        torch.mul(grad_reset_state, self.states(buffer, row, lo, k), out=slot_reset)
        grad_previous.addcmul_(grad_reset_state, reset)
        torch.ops.aten.sigmoid_backward.grad_input(slot_gates, gates, grad_input=slot_gates)
        # pre = D(window) band: the window's inputs and states of every layer of the band
        start, end = lay.window(lo, k)
        grad_diffused = torch.mm(slot, band.T, out=self.scratch("grad diffused", n, band.shape[0]))
        _diffuse(collect, grad_diffused.view(-1, end - start), add=grads[row, :, start:end])

    def weight_grads(self, name, windows, slots, candidate_slots, reset_states, blocks):
        """One layer's weight gradients over all the steps at once: D(window)^T slots and D(reset * h)^T
        candidate_slots, with D ("spread") over every step's samples in one product each. slots: the band's
        columns, or (the encoder) a (gates, candidate) pair of column ranges: one product each."""
        lay, rows, m = self.layout, windows.shape[0], self.layout.matrices
        spread, grads = self.operator("spread", blocks), self.packed_grad
        diffused = _diffuse(spread, windows.to(self.compute), out=self.scratch("spread", rows * m, windows.shape[1]))
        if isinstance(slots, tuple):
            torch.mm(diffused.view(rows, -1).T, slots[0], out=lay.view(grads, f"{name}_gates", grad=True))
            torch.mm(diffused.view(rows, -1).T, slots[1], out=lay.view(grads, f"{name}_candidate", grad=True))
        else:
            torch.mm(diffused.view(rows, -1).T, slots, out=lay.view(grads, f"{name}_band", grad=True))
        diffused = _diffuse(spread, reset_states, out=self.scratch("spread", rows * m, reset_states.shape[1]))
        torch.mm(diffused.view(rows, -1).T, candidate_slots, out=lay.view(grads, f"{name}_state", grad=True))

    def backward(self, grad_output, need_x: bool, need_teacher: bool):
        lay = self.layout
        u, layers, horizon, out_dim = lay.units, lay.layers, lay.horizon, lay.out_dim
        b, n, rows, steps, span = self.batch, self.nodes, self.rows, self.steps, self.span
        device, compute, packed, buffer = self.x.device, self.compute, self.packed, self.buffer
        grads = self.acquire(*buffer.shape, dtype=buffer.dtype).zero_()
        encoder, decoder = buffer[:self.encoder_rows], buffer[self.encoder_rows:]
        grad_enc, grad_dec = grads[:self.encoder_rows], grads[self.encoder_rows:]
        collect = self.operator("collect", b)

        # the decoder, last step first: the projection's gradient (its output's and, through the fed-back value,
        # the next step's input's), then the cells top down
        if out_dim == 1:
            grad_pred = grad_output.permute(1, 0, 2).to(compute).clone(memory_format=torch.contiguous_format)
        else:
            grad_pred = grad_output.new_zeros(horizon, b, n, out_dim, dtype=compute)
            grad_pred[..., 0] = grad_output.permute(1, 0, 2)
        grad_pred = grad_pred.view(horizon * rows, out_dim)
        slots_dec = self.acquire(layers, horizon, rows, 3 * u)
        bands = [(lay.view(packed, f"dec{i}_band"), lay.view(packed, f"dec{i}_state")) for i in range(layers)]
        proj, proj_fed = lay.view(packed, "proj"), self.proj_fed.transpose(2, 3)  # [T_out, B, output_dim, units + 1]
        top = slice(lay.offsets[layers], lay.offsets[layers + 1])
        grad_tops = grad_dec[layers:layers + horizon, :, top].view(horizon * rows, lay.block)
        if compute == self.dtype:  # the predictions' gradient, all the steps at once
            grad_tops.addmm_(grad_pred, proj.T)
        else:
            grad_tops.add_(torch.mm(grad_pred, proj.T))
        for t in reversed(range(horizon)):
            if t + 1 < horizon:  # the fed value's: per sample through proj_fed (0 where the true value was fed)
                grad_fed = grad_dec[t + 1, :, :out_dim].view(b, n, out_dim)
                grad_top = grad_dec[t + layers, :, top].view(b, n, lay.block)
                if compute == self.dtype:
                    grad_top.baddbmm_(grad_fed, proj_fed[t])
                else:
                    grad_top.add_(torch.bmm(grad_fed.to(compute), proj_fed[t]))
            for i in reversed(range(layers)):
                self.cell_backward(decoder, grad_dec, t + i, i, 1, self.saved_dec[i][t], *bands[i], collect,
                                   slots_dec[i, t])
        self.diagonal(grad_enc, steps).add_(self.diagonal(grad_dec, 0))

        # the encoder's wavefront, last step first
        slots_enc = self.acquire(span, rows, 3 * layers * u)
        band, state = lay.view(packed, "enc_band"), lay.view(packed, "enc_state")
        for s in reversed(range(span)):
            self.cell_backward(encoder, grad_enc, s, 0, layers, self.saved_enc[s], band, state, collect, slots_enc[s])

        # the weight gradients, all steps at once, into the gradients' layout; then unpacked by one gather
        self.packed_grad = packed_grad = self.acquire(lay.grad_size)
        slots, resets = slots_enc.view(span * rows, -1), self.reset_enc.view(span * rows, -1)
        for i in range(layers):
            start, end = lay.window(i, 1)
            gates = slots[:, 2 * u * i:2 * u * (i + 1)]
            candidate = slots[:, 2 * u * layers + u * i:2 * u * layers + u * (i + 1)]
            self.weight_grads(f"enc{i}", encoder[:span, :, start:end].view(span * rows, end - start),
                              (gates, candidate), candidate, resets[:, u * i:u * (i + 1)], span * b)
        for i in range(layers):
            start, end = lay.window(i, 1)
            slots = slots_dec[i].view(horizon * rows, -1)
            self.weight_grads(f"dec{i}", decoder[i:i + horizon, :, start:end].view(horizon * rows, end - start),
                              slots, slots[:, 2 * u:], self.reset_dec[i].view(horizon * rows, u), horizon * b)
        # the projection's gradient: its outputs' and, where the prediction was fed back, the fed values'
        grad_fed = grad_dec[1:horizon, :, :out_dim].view(horizon - 1, b, n, out_dim)
        fed_back = ~self.coins.T[:horizon - 1, :, None, None]  # [T_out - 1, B, 1, 1]: the prediction was fed back
        grad_pred.view(horizon, b, n, out_dim)[:horizon - 1].addcmul_(grad_fed, fed_back)
        tops = decoder[layers:layers + horizon, :, top].view(horizon * rows, lay.block).to(compute)
        torch.mm(tops.T, grad_pred, out=lay.view(packed_grad, "proj", grad=True))
        flat = packed_grad[self.state.unpack(device)].to(self.dtype)
        param_grads = [part.view(p.shape) for part, p in zip(flat.split([p.numel() for p in self.params]),
                                                             self.params, strict=True)]

        grad_x = grad_teacher = None
        if need_x:
            grad_x = grad_enc[:steps, :, :lay.in_dim].view(steps, b, n, lay.in_dim).permute(1, 0, 2, 3)
            grad_x = grad_x.to(self.x.dtype, copy=True)  # grads goes back to the pool
        if need_teacher:
            fed_true = grad_dec[1:horizon, :, :out_dim].view(horizon - 1, b, n, out_dim).sum(-1)
            grad_teacher = torch.zeros(b, horizon, n, dtype=self.teacher_dtype, device=device)
            grad_teacher[:, :horizon - 1] = (fed_true * self.coins.T[:horizon - 1, :, None]).permute(1, 0, 2)
        self.release()
        return grad_x, grad_teacher, param_grads


class _FusedDCRNN(torch.autograd.Function):
    """DCRNN's forward over a whole sequence with its hand-written backward (_Run): a few kernels per cell step."""

    @staticmethod
    def forward(ctx, model, compute_dtype, x, teacher, use_teacher, *params):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are explicit: products in compute_dtype
            run = _Run(model, x, teacher, use_teacher, params, compute_dtype)
            output = run.forward()
        if any(ctx.needs_input_grad):
            ctx.run = run
        else:  # no backward to come (evaluation, no_grad): the buffers can serve the next forward
            run.release()
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("DCRNN's fused backward runs once per forward (its buffers are reused): "
                               "a second backward through the same graph (retain_graph) is not supported")
        with torch.autocast(grad_output.device.type, enabled=False):
            grad_x, grad_teacher, param_grads = run.backward(grad_output, ctx.needs_input_grad[2],
                                                             ctx.needs_input_grad[3] and run.forcing)
        return None, None, grad_x, grad_teacher, None, *param_grads




@replaces(dcrnn.DCRNN)
class DCRNN(dcrnn.DCRNN):
    """The model file's DCRNN, with the fused sequence kernel where its sequence_kernel takes it (kernel_for: "fused",
    or "auto" on CUDA); the model file's cells elsewhere, and always when traced by torch.compile (the fused kernel's
    buffers and hand-written backward do not trace)."""

    def applies(self) -> bool:
        """Swapped in (toolkit.kernels.convert, on the module as written) only where the fused kernel runs: elsewhere
        the model's cells run as they are, with nothing to prove."""
        return DCRNN.kernel_for(self, next(self.parameters()).device) == "fused"

    def kernel_for(self, device: torch.device | str) -> str:
        """"fused" or "cells": the sequence kernel a forward on `device` takes (outside torch.compile)."""
        if self.sequence_kernel != "auto":
            return self.sequence_kernel
        return "fused" if torch.device(device).type == "cuda" else "cells"

    def forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.kernel_for(x.device) == "cells":
            return super().forward(x, teacher, use_teacher)
        return self.fused_forward(x, teacher, use_teacher)

    def fused_forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole sequence as one autograd Function (_FusedDCRNN); under autocast its products run in the
        autocast dtype, its states and their gradients in the parameters' dtype."""
        params = fused_parameters(self)
        dtype = compute = params[0].dtype
        if dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
            compute = torch.get_autocast_dtype(x.device.type)
        return _FusedDCRNN.apply(self, compute, x, teacher, use_teacher, *params)
