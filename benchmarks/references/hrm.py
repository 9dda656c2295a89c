"""Our HRM (toolkit/models/hrm.py, trained as recipes/hrm.py does) against sapientinc/HRM's own model code, the
time of one training step side by side, same sizes, same batches, in one process.

    git clone https://github.com/sapientinc/HRM /path/to/HRM      # once; nothing is fetched here
    python benchmarks/references/hrm.py --reference /path/to/HRM [--steps 20] [--rounds 5] [--threads 1]
                                        [--preset-sizes cpu-small|sudoku-1k]

The reference is the checkout's models/hrm/hrm_act_v1.py (HierarchicalReasoningModel_ACTV1), models/layers.py,
models/common.py, models/sparse_embedding.py (CastedSparseEmbedding and its SignSGD optimizer) and models/losses.py
(ACTLossHead, stablemax cross-entropy), imported from the checkout by path and run unchanged, with two stand-ins,
because neither runs without CUDA:
- models/layers.py imports flash_attn_func (FlashAttention 3's flash_attn_interface, else FlashAttention 2's
  flash_attn): a module `flash_attn_interface` is put in sys.modules whose flash_attn_func is torch's
  scaled_dot_product_attention on [batch, heads, positions, head_dim] (FlashAttention takes and returns [batch,
  positions, heads, head_dim]; same default scale, 1/sqrt(head_dim)).
- pretrain.py steps the weights with adam-atan2's fused CUDA kernel (not importable here): both sides use the
  toolkit's AdamATan2 (the same arithmetic, betas (0.9, 0.95)), so the optimizer costs the same on both sides.
Its forward_dtype is float32 (bfloat16 by default there; ours trains the cpu-small preset in float32 on CPU), and
neither side is compiled (pretrain.py torch.compiles unless DISABLE_COMPILE is set; ours only with --compile).

One step, as each code does it, the carry kept from step to step (halted rows take the batch's new puzzles):
- ours, recipes/hrm.py's loop body without Accelerate: HRM forward (the target-Q segment included), act_losses
  (stablemax), backward of loss / batch, gradient clipping at the preset's max_grad_norm (1.0 for cpu-small; 0, off,
  for sudoku-1k, as the reference never clips), AdamATan2, SparseSignSGD on the puzzle embedding, the warm-up
  scheduler, zero_grad;
- the reference, pretrain.py's train_batch at world size 1: ACTLossHead(HierarchicalReasoningModel_ACTV1) forward
  (the same two inner passes), backward of loss / batch, then for each optimizer (its sparse SignSGD, AdamATan2) the
  lr set, step and zero_grad.
Neither side's metric logging (a reduction and a copy every step in both programs) is timed.

Sizes (--preset-sizes): cpu-small (the default: recipes/hrm.py's preset; hidden 64, 4 heads, 1+1 layers, 1x1
cycles, at most 4 segments, batch 64) or sudoku-1k (the paper's: hidden 512, 8 heads, 4+4 layers, 2x2 cycles, at
most 16 segments, batch 768: 12x the batch, 12x the block passes per segment and some 50x the work per block
position of a cpu-small step, and tens of GB of activations in float32: a job for a big machine). Both: 81
cells, vocabulary 11, one puzzle embedding (puzzle_emb_ndim = hidden), RoPE, expansion 4, exploration 0.1.

Batches: random Sudoku-shaped ones (81 cells, digits as tokens 2..10, about half blanked to token 1, puzzle id 0),
the same ones in the same order on both sides, each in the dtypes its code reads (int32 there, int64 ours).
Halting decides which rows restart, never how much is computed: every step runs the whole batch on both sides.

Rounds: each runs --steps steps of each side, the order reversed every other round; one untimed step of each
first (first-call allocations).

Processes (--processes): `one` (the default) runs both sides in this process, on glibc's default heap: the model
code's time alone. `two` runs each side in a process of its own, every round (this script with --side): ours with
the heap a run of the toolkit keeps (toolkit.process.heap, set by start_run: freed memory stays for the next step), the
reference's as its pretrain.py has it (glibc's default, which returns a step's memory to the system and faults it
back in the next): each side as its own program runs.

Per round, each side's mean seconds per step and the ratio; then the medians, and the ratio (median of the rounds'
ratios) as the last line. --threads sets torch's intra-op threads (1: the cpu preset's).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

from side_by_side import PROJECT_ROOT, require_checkout, usage_error

REPOSITORY = "sapientinc/HRM"
MODEL_FILE = "models/hrm/hrm_act_v1.py"
VOCAB, CELLS = 11, 81  # recipes/hrm.py's Sudoku: 0 pad, 1 blank, 2..10 the digits
EXPLORATION = 11  # recipes/hrm.py's keyed-randomness purpose for the exploration coins
BATCHES = 8  # distinct batches, cycled through by both sides
# recipes/hrm.py's presets, the values a step's cost depends on (written out here, not imported: the recipe's
# preset table is parsed by its own flags machinery, and a benchmark must not start the recipe).
SIZES = {
    "cpu-small": dict(hidden=64, heads=4, expansion=4.0, h_layers=1, l_layers=1, h_cycles=1, l_cycles=1,
                      halt_max_steps=4, exploration_prob=0.1, batch=64, lr=1e-3, weight_decay=0.1,
                      puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=50, max_grad_norm=1.0),
    "sudoku-1k": dict(hidden=512, heads=8, expansion=4.0, h_layers=4, l_layers=4, h_cycles=2, l_cycles=2,
                      halt_max_steps=16, exploration_prob=0.1, batch=768, lr=1e-4, weight_decay=1.0,
                      puzzle_emb_lr=1e-4, puzzle_emb_weight_decay=1.0, warmup_steps=2000, max_grad_norm=0.0),
}


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """FlashAttention's flash_attn_func on CPU: [B, L, H, D] in and out, as scaled_dot_product_attention on
    [B, H, L, D]. Contiguous out, as FlashAttention returns it (models/layers.py views the output)."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2).contiguous()


def load_reference(root: Path) -> types.SimpleNamespace:
    """The checkout's model, loss head and sparse-embedding optimizer modules, imported from `root`."""
    shim = types.ModuleType("flash_attn_interface", "FlashAttention's flash_attn_func on CPU (benchmarks/references)")
    shim.flash_attn_func = flash_attn_func
    sys.modules["flash_attn_interface"] = shim
    # Its `models` folder has no __init__.py (a namespace package): made a package of its own here, so that any other
    # `models` installed on sys.path cannot take its place.
    package = types.ModuleType("models")
    package.__path__ = [str(root / "models")]
    sys.modules["models"] = package
    try:
        return types.SimpleNamespace(
            act=importlib.import_module("models.hrm.hrm_act_v1"),
            losses=importlib.import_module("models.losses"),
            sparse=importlib.import_module("models.sparse_embedding"),
        )
    except (ImportError, SyntaxError) as error:  # e.g. pydantic missing, or a checkout whose layout differs
        usage_error(f"--reference {root}: its model code does not load here ({type(error).__name__}: {error})")
        raise AssertionError("unreachable") from error


def make_batches(batch: int, seed: int):
    """BATCHES random Sudoku-shaped batches, as ours reads them (recipes/hrm.as_tokens) and as the reference's
    PuzzleDataset yields them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ours, theirs = [], []
    for index in range(BATCHES):
        labels = torch.randint(2, VOCAB, (batch, CELLS), generator=generator)
        inputs = torch.where(torch.rand(batch, CELLS, generator=generator) < 0.5, 1, labels)
        ids = torch.arange(index * batch, (index + 1) * batch)
        ours.append({"inputs": inputs, "labels": labels, "puzzle_ids": torch.zeros(batch, dtype=torch.long),
                     "ids": ids})
        theirs.append({"inputs": inputs.to(torch.int32), "labels": labels.to(torch.int32),
                       "puzzle_identifiers": torch.zeros(batch, dtype=torch.int32)})
    return ours, theirs


def our_side(sizes: dict, batches: list[dict], seed: int) -> Callable[[], None]:
    """One training step of ours per call (recipes/hrm.py's loop body, one process, without Accelerate)."""
    import torch

    from toolkit.kernels import converted
    from toolkit.models.hrm import HRM, AdamATan2, SparseSignSGD, act_losses

    s = sizes
    # the model as recipes/hrm.py trains it under --kernels auto: its fast paths swapped in (toolkit/kernels/)
    model = converted(HRM(VOCAB, CELLS, num_puzzle_ids=1, hidden=s["hidden"], heads=s["heads"],
                          expansion=s["expansion"], h_layers=s["h_layers"], l_layers=s["l_layers"],
                          h_cycles=s["h_cycles"], l_cycles=s["l_cycles"], halt_max_steps=s["halt_max_steps"],
                          exploration_prob=s["exploration_prob"], positions="rope"))
    model.train()
    optimizer = AdamATan2(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=s["weight_decay"])

    def warmup(steps_done: int) -> float:
        return min(1.0, (steps_done + 1) / s["warmup_steps"]) if s["warmup_steps"] else 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    puzzle_optimizer = SparseSignSGD(model.puzzle_emb, s["puzzle_emb_lr"], s["puzzle_emb_weight_decay"])
    state = {"carry": model.initial_carry(batches[0]), "step": 0}

    def step() -> None:
        state["step"] += 1
        data = batches[state["step"] % len(batches)]
        outputs = model(state["carry"], data, explore_key=(seed, EXPLORATION, state["step"]))
        loss, _ = act_losses(outputs, "stablemax")
        (loss / s["batch"]).backward()
        if s["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["max_grad_norm"])
        optimizer.step()
        puzzle_optimizer.step(lr=s["puzzle_emb_lr"] * warmup(state["step"] - 1))
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        puzzle_optimizer.zero_grad()
        state["carry"] = outputs["carry"]

    return step


def reference_side(reference, sizes: dict, batches: list[dict]) -> Callable[[], None]:
    """One training step of the reference per call (pretrain.py's train_batch at world size 1, without compile)."""
    from toolkit.models.hrm import AdamATan2

    s = sizes
    config = dict(batch_size=s["batch"], seq_len=CELLS, puzzle_emb_ndim=s["hidden"], num_puzzle_identifiers=1,
                  vocab_size=VOCAB, H_cycles=s["h_cycles"], L_cycles=s["l_cycles"], H_layers=s["h_layers"],
                  L_layers=s["l_layers"], hidden_size=s["hidden"], expansion=s["expansion"], num_heads=s["heads"],
                  pos_encodings="rope", halt_max_steps=s["halt_max_steps"],
                  halt_exploration_prob=s["exploration_prob"], forward_dtype="float32")
    model = reference.losses.ACTLossHead(reference.act.HierarchicalReasoningModel_ACTV1(config),
                                         loss_type="stablemax_cross_entropy")
    model.train()
    optimizers = [
        reference.sparse.CastedSparseEmbeddingSignSGD_Distributed(
            model.model.puzzle_emb.buffers(), lr=0, weight_decay=s["puzzle_emb_weight_decay"], world_size=1
        ),
        AdamATan2(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=s["weight_decay"]),
    ]
    optimizer_lrs = [s["puzzle_emb_lr"], s["lr"]]  # its cosine schedule's value: a number per step, no work
    state = {"carry": model.initial_carry(batches[0]), "step": 0}

    def step() -> None:
        state["step"] += 1
        batch = batches[state["step"] % len(batches)]
        state["carry"], loss, _metrics, _, _ = model(carry=state["carry"], batch=batch, return_keys=[])
        ((1 / s["batch"]) * loss).backward()
        for optimizer, lr in zip(optimizers, optimizer_lrs, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad()

    return step


def timed(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def in_own_process(side: str, args: argparse.Namespace, root: Path) -> float:
    """Mean seconds per step of `side`, timed by this script in a process of its own (--processes two)."""
    command = [sys.executable, __file__, "--reference", str(root), "--steps", str(args.steps), "--threads",
               str(args.threads), "--preset-sizes", args.preset_sizes, "--seed", str(args.seed), "--side", side]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the {side} side's process failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = usage_error  # a bad flag is one `error:` line, exit 2, like every other refusal here
    parser.add_argument("--reference", type=Path, help=f"a checkout of {REPOSITORY}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each side per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, alternating which side goes first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the cpu preset's)")
    parser.add_argument("--preset-sizes", choices=sorted(SIZES), default="cpu-small",
                        help="recipes/hrm.py preset whose sizes both sides train at")
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and exploration")
    parser.add_argument("--processes", choices=("one", "two"), default="one",
                        help="one: both sides in this process (glibc's default heap); two: each in its own process, "
                             "ours with the heap a toolkit run keeps (toolkit.process.heap)")
    parser.add_argument("--side", choices=("ours", "reference"), help=argparse.SUPPRESS)  # --processes two's child
    args = parser.parse_args()
    root = require_checkout(args.reference, MODEL_FILE, REPOSITORY)
    for name in ("steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            usage_error(f"--{name} {getattr(args, name)} is invalid; give an integer >= 1")

    sys.path.insert(0, str(PROJECT_ROOT))  # the toolkit, when not installed
    import torch  # heavy: only once the checks passed

    torch.set_num_threads(args.threads)
    reference = load_reference(root)
    sizes = SIZES[args.preset_sizes]
    ours_batches, reference_batches = make_batches(sizes["batch"], args.seed)
    torch.manual_seed(args.seed)  # both sides' initial weights; the reference's exploration draws
    if args.side:  # a child of --processes two: one side, its heap as its program has it, one timed stretch
        if args.side == "ours":
            from toolkit.process import heap

            heap.keep_between_steps()
        step = (our_side(sizes, ours_batches, args.seed) if args.side == "ours"
                else reference_side(reference, sizes, reference_batches))
        step()
        print(f"seconds per step {timed(step, args.steps)!r}")
        return
    names = ["ours", "reference"]
    if args.processes == "one":
        sides = {"ours": our_side(sizes, ours_batches, args.seed),
                 "reference": reference_side(reference, sizes, reference_batches)}
        for step in sides.values():  # first-call allocations and lazy initialisation, not timed
            step()
    heaps = ("both sides in this process, glibc's default heap" if args.processes == "one" else
             "each side in its own process: ours with the heap kept between steps (toolkit.process.heap, as a run), "
             "the reference's glibc's default")
    print(
        f"HRM {args.preset_sizes} sizes {sizes}, fp32, {args.steps} step(s) of each per round, {args.rounds} "
        f"round(s), {args.threads} thread(s); reference {root} with SDPA in place of FlashAttention and our "
        f"AdamATan2 for both; {heaps}",
        flush=True,
    )
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for index in range(args.rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            seconds[name].append(timed(sides[name], args.steps) if args.processes == "one" else
                                 in_own_process(name, args, root))
        ours, theirs = seconds["ours"][-1], seconds["reference"][-1]
        print(f"round {index + 1}/{args.rounds}: ours {ours * 1e3:.1f} ms/step, reference {theirs * 1e3:.1f} "
              f"ms/step; reference/ours = {theirs / ours:.2f}x", flush=True)
    for name, times in seconds.items():
        print(f"median {name:9} {statistics.median(times) * 1e3:8.1f} ms/step")
    per_round = [t / o for o, t in zip(seconds["ours"], seconds["reference"], strict=True)]
    from toolkit.run.precision import cpu_kind

    print(f"CPU: {cpu_kind(threads=args.threads)}")
    print(f"ratio reference/ours per step = {statistics.median(per_round):.2f} (median of the rounds, "
          f"{min(per_round):.2f}-{max(per_round):.2f})")


if __name__ == "__main__":
    main()
