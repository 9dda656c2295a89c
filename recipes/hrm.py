"""HRM, the Hierarchical Reasoning Model, on Sudoku: one training run from a laptop CPU to 8 GPUs.

    python recipes/hrm.py              # the cpu-small preset on easy generated puzzles (about 11 min on 2 cores)
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/hrm.py --preset sudoku-1k --data DIR
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/hrm.py --resume-from auto

Presets (`--preset`): cpu-small (the default: a small model on easy generated puzzles, about 11 minutes on 2 cores) and
sudoku-1k (the paper's settings: global batch 768, lr 1e-4, puzzle-embedding lr 1e-4, weight decay 1.0, warm-up
2000 steps, 20000 epochs, evaluation every 2000, hidden 512, 4+4 layers, 2x2 cycles, 16 halting steps, on 1000
puzzles x 1000 augmentations: 26,040 steps of 768 as the reference takes). Its figure to compare with, 55% exact
accuracy, is on Sudoku-Extreme: without --data the preset generates hard puzzles (min rating 20) and says so in one
line. The published run: --data DIR, the folder holding Sudoku-Extreme's train.csv and test.csv, and --full-test
(test on all of test.csv). On a GPU sudoku-1k computes in bf16 as the reference (its forward_dtype), unless
--mixed-precision or the launch config says otherwise; on a CPU in fp32, said in one line. Any flag overrides the
preset's value.

Features: the H/L recurrent modules with the one-step gradient and ACT halting by Q-learning with exploration
(toolkit/models/hrm.py); the carry across batches (halted rows take new puzzles, running rows keep theirs) kept per
rank in every checkpoint, so a resume is bit-identical; exploration coins keyed by (seed, step, sample), so N
processes train as one; the sparse puzzle-embedding table updated by SignSGD on the rows of the global batch
(gathered from every rank, duplicates summed, one update everywhere); AdamATan2 (or SGD) for the weights with a
linear warm-up; stablemax or softmax cross-entropy. An epoch is one pass over the ORIGINAL training puzzles, each
seen as one of its augmentations (chosen per epoch), as in the paper; batches run across epoch boundaries (no puzzle
left out at an epoch's end) in streams of --eval-every epochs, whose incomplete last batch is dropped, as the
reference's epochs_per_iter (toolkit.run.sampler; with --eval-every-steps, one stream for the whole run). Evaluation
runs every puzzle for the maximum number of segments and reports exact accuracy (whole puzzles right), blank-cell
and all-cell accuracy; training logs lm loss, Q losses, accuracies, q-halt accuracy and mean segments of the rows
that halted, and the lr, all as sums over ranks divided by counts. --eval-full-test-every N also evaluates the whole
test split every N steps, as the reference's pretrain.py at every evaluation (full_test_*: logged at that step, the
latest in every metrics.csv row). --init-from-reference PATH starts from a checkpoint of the reference
implementation, mapped by name (toolkit/models/hrm_reference_checkpoint.py).

Data: --data DIR, a dataset built by `python -m toolkit.data.sudoku build`, or a folder holding the public
Sudoku-Extreme train.csv and test.csv (converted once into --cache-dir with --train-puzzles, --aug, ...; every
rating, no filter; --full-test: all of test.csv); without --data, the preset's generated puzzles are built once into
--cache-dir.

Errors (one line, exit 2, before anything is written): a --data that does not exist or is not a Sudoku dataset, a
CSV row with a wrong-length grid, a character other than 1-9 and '.', an answer that breaks the rules or the puzzle
(named by file and line); --full-test without a folder of CSVs; out-of-range numbers; --grad-accum other than 1 (the
carry steps every batch); a batch larger than the training puzzles; an --init-from-reference file that is missing,
unreadable, or does not fit the model (a shape that differs, a tensor of ours it lacks, settings other than those of
the all_config.yaml beside it); and every shared-flag error (see README).
"""

from __future__ import annotations

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before anything heavy: SIGUSR1 (pre-emption) only sets a flag from here on; OpenMP's policy

# isort: split
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader

from toolkit import (
    CrossEpochBatchSampler,
    Run,
    TrainConfig,
    TrainingLoop,
    UsageError,
    device_batches,
    keyed_hash,
    main_process_first,
    make_optimizer,
    model_line,
    one_line_errors,
    parse_config,
    pin_memory,
    require_at_least,
    require_batch_fits,
    require_finite,
    require_path,
    require_range,
    runs_on_cpu,
    start_run,
)
from toolkit.data.sudoku import VALID_DATA, Recipe, is_csv_folder, load_sudoku, split, stored_columns
from toolkit.kernels.hrm import rows_to_exercise
from toolkit.models.hrm import HRM, SparseSignSGD, act_losses, ratios
from toolkit.models.hrm_reference_checkpoint import (
    load_reference_checkpoint,
    map_reference_state,
    read_reference_state,
    refuse_other_settings,
)

EXPLORATION, AUGMENTATION_PICK = 11, 12  # purposes of keyed randomness
VOCAB = 11  # 0 pad, 1 blank, 2..10 the digits 1..9
CELLS = 81


@dataclass
class HRMConfig(TrainConfig):
    """HRM on Sudoku; the defaults are the `cpu-small` preset's (PRESETS below)."""

    # Flags added after runs were made: a run whose config.json lacks one resumes with this value (not a flag)
    added_flags = {"eval_full_test_every": 0}

    data: Path | None = None
    """A dataset built by `python -m toolkit.data.sudoku build`, or a folder with the Sudoku-Extreme train.csv and
    test.csv. Default: the preset's generated puzzles, built once into --cache-dir."""
    cache_dir: Path = Path("~/.cache/accelerate-recipes")
    """Where generated and converted datasets are kept."""
    train_puzzles: int = 4000
    """Original training puzzles (generated data or a CSV folder)."""
    aug: int = 4
    """Augmented copies of each training puzzle (digit relabelling, transpose, band/row and stack/column moves)."""
    val_puzzles: int = 256
    """Held-out puzzles for validation (other originals than the training ones)."""
    test_puzzles: int = 512
    """Held-out puzzles for the final test (sampled from test.csv with CSV data)."""
    full_test: bool = False
    """Test on every puzzle of the Sudoku-Extreme test.csv (the paper's test set; needs --data with the CSVs)."""
    min_rating: int = 0
    """Generated puzzles only: keep those whose rating (the project solver's backtracks) is at least this.
    Sudoku-Extreme CSVs are used with every rating, as the paper does."""
    max_blanks: int = 8
    """Generated puzzles blank at most this many cells (81: as many as uniqueness allows; fewer: easier)."""
    hidden: int = 64
    """Hidden size of both modules."""
    heads: int = 4
    """Attention heads (hidden must divide by it)."""
    expansion: float = 4.0
    """SwiGLU width: 2/3 x expansion x hidden, rounded up to a multiple of 256."""
    h_layers: int = 1
    """Blocks of the slow (H) module."""
    l_layers: int = 1
    """Blocks of the fast (L) module."""
    h_cycles: int = 1
    """H updates per segment."""
    l_cycles: int = 1
    """L updates per H update."""
    halt_max_steps: int = 4
    """Most segments a puzzle gets (ACT); evaluation always runs this many."""
    exploration_prob: float = 0.1
    """Probability that a training puzzle is forced to a random minimum of 2..halt_max_steps segments."""
    positions: Literal["rope", "learned"] = "rope"
    """Position encoding: rotary, or a learned table added to the input."""
    loss: Literal["stablemax", "softmax"] = "stablemax"
    """Cross-entropy over the digits: stablemax (the paper; float64) or softmax."""
    optimizer: Literal["adam-atan2", "sgd"] = "adam-atan2"
    """AdamATan2 with betas (0.9, 0.95) (the paper), or plain SGD (for exactness checks)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the weights."""
    puzzle_emb_lr: float = 1e-2
    """Learning rate of the sparse puzzle-embedding table (SignSGD)."""
    puzzle_emb_weight_decay: float = 0.1
    """Decoupled weight decay of the puzzle-embedding rows in the batch."""
    warmup_steps: int = 50
    """Linear learning-rate warm-up (both optimisers), then constant."""
    eval_full_test_every: int = 0
    """Also evaluate the WHOLE test split (all of test.csv with --full-test) every N optimizer steps, as the
    reference's pretrain.py does at every evaluation, for the paper's curves: full_test_* metrics, each rank its share
    gathered, logged to the tracker at that step; every metrics.csv row holds the latest (full_test_step says which).
    sudoku-1k: 2604 = the reference's interval (2000 epochs). 0 = off."""
    init_from_reference: Path | None = None
    """Start from a checkpoint of the reference implementation (sapientinc/HRM pretrain.py's step_N file: a
    torch.save'd state dict, with or without torch.compile's `_orig_mod.` prefix), its tensors mapped onto ours by
    name; the model flags must be those it was trained with (refused in one line otherwise)."""
    # Shared flags: the cpu-small preset's values.
    epochs: int = 64
    batch_size: int = 64
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    eval_every: int = 4


# --preset NAME (toolkit.run.presets): the first is the default; any flag given overrides the preset's value.
PRESETS = {
    "cpu-small": ("a small model on easy generated puzzles (<= 8 blanks), about 11 minutes on 2 cores", HRMConfig()),
    "sudoku-1k": (
        "the paper's settings: 1000 puzzles x 1000 augmentations, batch 768, 26,040 steps (Sudoku-Extreme with "
        "--data DIR --full-test, else generated hard puzzles)",
        HRMConfig(
            train_puzzles=1000, aug=1000, val_puzzles=100, test_puzzles=1000, min_rating=20, max_blanks=81,
            hidden=512, heads=8, h_layers=4, l_layers=4, h_cycles=2, l_cycles=2, halt_max_steps=16,
            weight_decay=1.0, puzzle_emb_lr=1e-4, puzzle_emb_weight_decay=1.0, warmup_steps=2000, epochs=20000,
            batch_size=768, lr=1e-4, max_grad_norm=0.0, eval_every=2000,
        ),
    ),
}


def check(cfg: HRMConfig) -> None:
    """Recipe-specific checks, before anything is built."""
    require_path(cfg.data, "--data", f"{VALID_DATA}, or omit it")
    if cfg.full_test and (cfg.data is None or not is_csv_folder(cfg.data.expanduser())):
        what = "generated puzzles have no test.csv" if cfg.data is None else \
            f"--data {cfg.data} is not a folder of Sudoku-Extreme CSVs (a built dataset's test split is fixed)"
        raise UsageError(f"--full-test tests on every puzzle of the Sudoku-Extreme test.csv; {what}: give --data "
                         "with the folder holding train.csv and test.csv")
    require_at_least(cfg, 1, "hidden", "heads", "h_layers", "l_layers", "h_cycles", "l_cycles", "halt_max_steps")
    if cfg.hidden % cfg.heads or (cfg.hidden // cfg.heads) % 2:
        raise UsageError(f"--hidden {cfg.hidden} must divide by --heads {cfg.heads} into an even head size")
    require_range(cfg, "[0, 1]", "exploration_prob")
    require_finite(cfg, "expansion", "puzzle_emb_lr", inclusive=False)
    require_finite(cfg, "weight_decay", "puzzle_emb_weight_decay")
    if cfg.warmup_steps < 0:
        raise UsageError(f"--warmup-steps {cfg.warmup_steps} is invalid; it must be >= 0 (0 = no warm-up)")
    if cfg.grad_accum != 1:
        raise UsageError(f"--grad-accum {cfg.grad_accum} is not supported by HRM: its carry advances one segment per "
                         "batch; use --grad-accum 1 and a larger --batch-size")
    if cfg.eval_full_test_every < 0:
        raise UsageError(f"--eval-full-test-every {cfg.eval_full_test_every} is invalid; it must be >= 0 (N: the "
                         "whole test split every N optimizer steps; 0 = off)")
    if cfg.init_from_reference is not None:  # read and fitted to the model (built on the meta device) before any data
        with torch.device("meta"):
            expected = build_model(cfg).state_dict()
        state = read_reference_state(cfg.init_from_reference)
        refuse_other_settings(cfg.init_from_reference, {  # (its all_config.yaml, when beside it, names the flags)
            "--hidden": cfg.hidden, "--heads": cfg.heads, "--expansion": cfg.expansion, "--h-layers": cfg.h_layers,
            "--l-layers": cfg.l_layers, "--h-cycles": cfg.h_cycles, "--l-cycles": cfg.l_cycles,
            "--positions": cfg.positions})
        map_reference_state(state, expected, cfg.init_from_reference)
    data_recipe(cfg).check()
    if cfg.data is None:  # generated data: the count is known before generating anything
        check_batch_fits(cfg.batch_size, cfg.train_puzzles)


def check_batch_fits(batch_size: int, train_puzzles: int) -> None:
    require_batch_fits(batch_size, train_puzzles, "training puzzles (an epoch is one pass over them)",
                       "use a smaller batch or more --train-puzzles")


def build_model(cfg: HRMConfig) -> HRM:
    return HRM(VOCAB, CELLS, num_puzzle_ids=1, hidden=cfg.hidden, heads=cfg.heads, expansion=cfg.expansion,
               h_layers=cfg.h_layers, l_layers=cfg.l_layers, h_cycles=cfg.h_cycles, l_cycles=cfg.l_cycles,
               halt_max_steps=cfg.halt_max_steps, exploration_prob=cfg.exploration_prob, positions=cfg.positions)


# A preset's forward precision on a GPU when neither --mixed-precision nor the launch config asks for one: sudoku-1k
# computes in bf16 there, as the reference (models/hrm/hrm_act_v1.py:57, forward_dtype "bfloat16"), the toolkit's way
# (Accelerate's bf16 autocast: matmuls in bf16, the weights, norms and carry in fp32). A CPU keeps fp32.
GPU_PRECISION = {"sudoku-1k": "bf16"}


def preset_precision(flag: str | None, preset: str | None, device_type: str,
                     launch_config: str | None = None) -> tuple[str | None, str | None]:
    """(--mixed-precision to run with, a line to say at the start or None). flag: --mixed-precision as given (None:
    not given); device_type: "cuda" or "cpu", what the run computes on; launch_config: the launcher's choice
    (ACCELERATE_MIXED_PRECISION; its "no" is Accelerate's default when a config names none, so it is no choice)."""
    wanted = GPU_PRECISION.get(preset or "")
    if wanted is None or flag is not None or launch_config not in (None, "", "no"):
        return flag, None
    if device_type != "cuda":
        return flag, (f"--preset {preset}: fp32 on the {device_type.upper()} (the preset's {wanted} forward, as the "
                      f"reference's, applies on a GPU; --mixed-precision {wanted} asks for it here)")
    return wanted, None


def data_recipe(cfg: HRMConfig) -> Recipe:
    return Recipe(cfg.train_puzzles, cfg.aug, cfg.val_puzzles, cfg.test_puzzles, cfg.min_rating, cfg.max_blanks,
                  cfg.seed)


class OneAugmentationPerPuzzle(torch.utils.data.Dataset):
    """Item (epoch, i) = one augmentation of original training puzzle i, picked by keyed randomness from the epoch it
    is drawn in (the same on every rank and after a resume), read from the memory-mapped table. The reference picks
    one of the puzzle's 1 + aug versions at random each time it is drawn."""

    def __init__(self, rows, copies: int, seed: int):
        self.rows, self.copies, self.seed = rows, copies, seed

    def __len__(self) -> int:
        return len(self.rows) // self.copies

    def table_rows(self, drawn: torch.Tensor) -> torch.Tensor:
        """The table rows of (epoch, puzzle) pairs [..., 2]: each puzzle's augmentation picked by keyed randomness."""
        epochs, puzzles = drawn.unbind(-1)
        return puzzles * self.copies + keyed_hash(self.seed, AUGMENTATION_PICK, epochs, puzzles) % self.copies

    def __getitems__(self, drawn: list[tuple[int, int]]) -> list[dict]:
        columns = self.rows[self.table_rows(torch.as_tensor(drawn).view(-1, 2)).tolist()]
        return [{name: column[i] for name, column in columns.items()} for i in range(len(columns["id"]))]

    def __getitem__(self, drawn: tuple[int, int]) -> dict:
        return self.__getitems__([drawn])[0]

    # toolkit.run.device_data: every stored version on the device; the rows picked on the host once an epoch
    def device_bytes(self) -> int:
        one_row = stored_columns(self.rows.select(range(1)))
        return len(self.rows) * sum(column.numel() * column.element_size() for column in one_row.values())

    def device_index(self, order: torch.Tensor) -> torch.Tensor:
        """The epoch's (epoch, puzzle) pairs [batches, B, 2] as table rows [batches, B], on the host at once."""
        return self.table_rows(order)

    def on_device(self, device: torch.device):
        """Every row of the table on `device` in its stored dtypes (int8 cells); cut(rows) = the collated batch of
        those table rows (device_index's), as the DataLoader gives it (int64, the torch format's)."""
        columns = {name: column.to(device) for name, column in stored_columns(self.rows).items()}
        return lambda rows: {name: column[rows].long() for name, column in columns.items()}


def as_tokens(batch: dict) -> dict:
    """The model's view of a batch of stored puzzles: tokens 1 = blank, 2..10 = digits."""
    return {"inputs": batch["question"].long() + 1, "labels": batch["answer"].long() + 1,
            "puzzle_ids": torch.zeros_like(batch["id"]),  # Sudoku: one shared puzzle embedding (the paper's)
            "ids": batch["id"].long()}


class Carry:
    """Per-rank checkpoint state: each row's recurrent state, segment count, halted flag and puzzle."""

    def __init__(self):
        self.state: dict | None = None

    def state_dict(self):
        return {"state": None if self.state is None else {k: v.cpu() for k, v in self.state.items()}}

    def load_state_dict(self, saved):
        self.state = saved["state"]

    def on(self, device) -> dict | None:
        if self.state is not None:
            self.state = {k: v.to(device) for k, v in self.state.items()}
        return self.state


class MetricSums:
    """Shared checkpoint state: training sums (over ranks) since the last log line, kept on the device (float64) and
    read on the host only when logged or saved."""

    def __init__(self):
        self.names: list[str] = []
        self.totals: torch.Tensor | None = None

    def add(self, names: list[str], totals: torch.Tensor) -> None:
        self.names = list(names)
        self.totals = totals.double() if self.totals is None else self.totals.to(totals.device) + totals.double()

    @property
    def sums(self) -> dict[str, float]:
        if self.totals is None:
            return {}
        return dict(zip(self.names, self.totals.tolist(), strict=True))

    def clear(self) -> None:
        self.totals = None

    def state_dict(self):
        return {"sums": self.sums}

    def load_state_dict(self, saved):
        self.names = list(saved["sums"])
        self.totals = torch.tensor(list(saved["sums"].values()), dtype=torch.float64) if saved["sums"] else None


PUZZLE_METRICS = ("exact_accuracy", "blank_accuracy", "token_accuracy", "q_halt_accuracy", "puzzles")  # after a prefix
FULL_TEST = "full_test"  # --eval-full-test-every's metrics: full_test_exact_accuracy, ... (test_*: the final test)


class LatestFullTest:
    """Shared checkpoint state with --eval-full-test-every: the latest evaluation of the whole test split (its step
    and metrics), which every metrics.csv row holds (empty before the first); the tracker has each at its step."""

    def __init__(self):
        self.step: int | None = None
        self.metrics: dict = {}

    def record(self, step: int, metrics: dict) -> None:
        self.step, self.metrics = step, dict(metrics)

    def columns(self) -> dict:
        names = [f"{FULL_TEST}_{name}" for name in PUZZLE_METRICS]
        return {f"{FULL_TEST}_step": self.step, **{name: self.metrics.get(name) for name in names}}

    def state_dict(self):
        return {"step": self.step, "metrics": dict(self.metrics)}

    def load_state_dict(self, saved):
        self.step, self.metrics = saved["step"], dict(saved["metrics"])


def per_row_loss(rank_sum: torch.Tensor, num_processes: int, batch_size: int) -> torch.Tensor:
    """What each rank backpropagates: DDP's average over ranks of it is the gradient of the GLOBAL batch's mean row."""
    return rank_sum * (num_processes / batch_size)  # rank_sum: act_losses' total over this rank's rows


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PRESETS, argv, description=__doc__, check=check)
    cfg.mixed_precision, precision_line = preset_precision(cfg.mixed_precision, cfg.preset,
                                                           "cpu" if runs_on_cpu() else "cuda",
                                                           os.environ.get("ACCELERATE_MIXED_PRECISION"))
    # The puzzle-embedding table is a buffer updated identically on every rank: DDP must not broadcast it.
    with start_run(cfg, recipe="hrm", ddp_kwargs={"broadcast_buffers": False}) as run:
        if precision_line:
            run.print(precision_line)
        return train(run, cfg)


def train(run: Run, cfg: HRMConfig) -> dict:
    accelerator = run.accelerator

    # ---- data: built (or converted) once by the main process, memory-mapped by every rank ---------------------
    prepared = main_process_first(
        run, lambda: load_sudoku(cfg.data, data_recipe(cfg), cfg.cache_dir.expanduser(), progress=run.is_main,
                                 full_test=cfg.full_test)
    )
    stored, meta = prepared
    prepared.describe(run, **meta["puzzles"], aug=meta["aug"])
    if cfg.preset == "sudoku-1k" and not meta["source"].startswith("csv:"):
        run.print("note: the paper's figure (55% exact accuracy) is on Sudoku-Extreme; give --data with its "
                  "train.csv and test.csv (and --full-test) to compare; going on with generated puzzles")
    columns = ["id", "question", "answer"]
    train_set = OneAugmentationPerPuzzle(split(stored, meta, "train").select_columns(columns), 1 + meta["aug"],
                                         cfg.seed)
    valid_set = split(stored, meta, "val").select_columns(columns)
    test_set = split(stored, meta, "test").select_columns(columns)
    check_batch_fits(cfg.batch_size, len(train_set))  # a built dataset or CSVs: known once loaded
    loader_args = dict(
        batch_size=cfg.batch_size, num_workers=cfg.num_workers, pin_memory=pin_memory(accelerator.device)
    )
    # Batches run across epoch boundaries (no puzzle left out at an epoch's end), in streams of --eval-every epochs
    # as the reference's epochs_per_iter: sudoku-1k takes 10 x floor(2000 x 1000 / 768) = 26,040 steps of 768.
    train_batches = CrossEpochBatchSampler(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs,
                                           epochs_per_cycle=None if cfg.eval_every_steps else cfg.eval_every,
                                           with_epoch=True)
    # On the device, cut there per rank (toolkit.run.device_data); a set too large for it goes through a DataLoader.
    train_loader = device_batches(run, train_set, train_batches, num_workers=cfg.num_workers,
                                  pin_memory=pin_memory(accelerator.device))
    valid_loader = DataLoader(valid_set, shuffle=False, **loader_args)
    test_loader = DataLoader(test_set, shuffle=False, **loader_args)
    run.print(f"data: {meta['puzzles']} puzzles, {meta['aug']} augmentations each for training ({meta['source']})")

    # ---- model and optimisation ----------------------------------------------------------------------------
    model = build_model(cfg)
    if cfg.init_from_reference is not None and run.resume_checkpoint is None:  # (a resume loads its own weights)
        for line in load_reference_checkpoint(model, cfg.init_from_reference):
            run.print(line)
    # --kernels auto: the CPU kernels swapped in, proven on the first block's calls for as many validation puzzles as
    # take every kernel a block takes (1 at hidden 512, 4 at 64), or the batch's, if smaller
    puzzles = min(cfg.batch_size // accelerator.num_processes, -(-rows_to_exercise(cfg.hidden) // (CELLS + 1)))
    some = {k: v.to(accelerator.device) for k, v in as_tokens(next(iter(DataLoader(valid_set, batch_size=puzzles))))
            .items()}
    model = run.with_kernels(model, lambda m: m(m.initial_carry(some), some, (cfg.seed, 0, 0)))
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                               weight_decay=cfg.weight_decay)

    def warmup(steps_done: int) -> float:
        return min(1.0, (steps_done + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, scheduler, valid_loader, test_loader = accelerator.prepare(
        model, optimizer, scheduler, valid_loader, test_loader
    )
    core = accelerator.unwrap_model(model)
    puzzle_optimizer = SparseSignSGD(core.puzzle_emb, cfg.puzzle_emb_lr, cfg.puzzle_emb_weight_decay,
                                     gather=accelerator.gather)
    run.print(model_line(f"HRM {cfg.h_layers}+{cfg.l_layers} layers, hidden {cfg.hidden}, {cfg.h_cycles}x"
                         f"{cfg.l_cycles} cycles, at most {cfg.halt_max_steps} segments", core))

    carry, train_sums, full_test = Carry(), MetricSums(), LatestFullTest()
    # With --eval-full-test-every, the latest full test is checkpointed (a resumed run writes the same rows)
    state = {"train_sums": train_sums, **({FULL_TEST: full_test} if cfg.eval_full_test_every else {})}
    loop = TrainingLoop(run, model, train_loader, evaluate=lambda: puzzle_metrics(valid_loader, "val"),
                        main_metric="val_exact_accuracy", state=state,
                        rank_state={"carry": carry}, batches_per_epoch=train_batches.batches_in_epoch,
                        # every metrics.csv row: the latest full test
                        row_columns=full_test.columns if cfg.eval_full_test_every else None)

    def puzzle_metrics(loader, prefix):
        """Every puzzle run for the maximum number of segments; sums over all ranks' puzzles / counts."""
        sums = torch.zeros(5, dtype=torch.float64)
        for batch in loader:
            data = as_tokens(batch)
            state = core.initial_carry(data)
            for _ in range(cfg.halt_max_steps):
                with accelerator.autocast():
                    outputs = model(state, data)
                state = outputs["carry"]
            correct = outputs["logits"].argmax(-1) == data["labels"]
            blanks = data["inputs"] == 1
            exact = correct.all(dim=-1)
            per_puzzle = torch.stack([correct.sum(-1), (correct & blanks).sum(-1), blanks.sum(-1), exact,
                                      (outputs["q_halt"] >= 0) == exact], dim=1).double()
            sums += accelerator.gather_for_metrics(per_puzzle).sum(dim=0).cpu()
        right, blank_right, blanks, exact, q_right = sums.tolist()
        puzzles = len(loader.dataset)
        return {f"{prefix}_exact_accuracy": exact / puzzles, f"{prefix}_blank_accuracy": blank_right / max(blanks, 1),
                f"{prefix}_token_accuracy": right / (puzzles * CELLS), f"{prefix}_q_halt_accuracy": q_right / puzzles,
                f"{prefix}_puzzles": puzzles}

    def log_train_sums(values: list[float]) -> None:  # read with the loss, every --log-every steps
        step = loop.global_step
        accelerator.log({**ratios(dict(zip(train_sums.names, values, strict=True))),
                         "train/lr": cfg.lr * warmup(step - 1)}, step=step)
        train_sums.clear()

    loop.read_with_loss(lambda: train_sums.totals, log_train_sums)

    # ---- train: one segment per batch; halted rows take new puzzles, the others go on thinking -------------
    loop.start()
    for _ in loop.epochs():
        for batch in loop.batches():
            step = loop.global_step + 1  # the optimizer step this batch makes
            data = as_tokens(batch)
            state = carry.on(accelerator.device) or core.initial_carry(data)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    outputs = model(state, data, explore_key=(cfg.seed, EXPLORATION, step))
                    loss, sums = act_losses(outputs, cfg.loss)
                # DDP averages over ranks: this makes the gradient that of (sum over the global batch) / batch size.
                accelerator.backward(per_row_loss(loss, accelerator.num_processes, cfg.batch_size))
                totals = torch.stack([loss.detach().double(), *sums.values()])
                totals = accelerator.reduce(totals, reduction="sum")  # every rank's rows: a collective, no host read
                puzzle_optimizer.lr = cfg.puzzle_emb_lr * warmup(step - 1)
                loop.optimizer_step([optimizer, puzzle_optimizer], scheduler, loss=totals[0].float() / cfg.batch_size)
            # --cuda-graphs: the graph's next replay (or an evaluation's) overwrites its outputs; the carry keeps a copy
            carry.state = {k: v.clone() for k, v in outputs["carry"].items()} if cfg.cuda_graphs else outputs["carry"]
            train_sums.add(list(sums), totals[1:])
            if cfg.eval_full_test_every and step % cfg.eval_full_test_every == 0:
                # The whole test split, as pretrain.py at every evaluation: each rank its share, gathered; no random
                # stream drawn (the next batch reseeds anyway); logged at this step, before its checkpoint is saved
                full_test.record(step, loop.evaluate_now(lambda: puzzle_metrics(test_loader, FULL_TEST), step))
        loop.end_epoch()

    # ---- test: the best validation checkpoint on the held-out puzzles ------------------------------------------
    return loop.finish_at_best(lambda: puzzle_metrics(test_loader, "test"))


if __name__ == "__main__":
    main()
