"""The flags every recipe shares, and parsing them with tyro into one-line errors.

A recipe's config dataclass subclasses `TrainConfig`, overriding defaults and adding its own fields, so every
recipe has the same `--output-dir`, `--resume-from`, `--batch-size`, ... with the same meaning. Its named presets
(`--preset NAME`) are parsed here too (toolkit.run.presets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import tyro

from toolkit.errors import UsageError
from toolkit.run import presets as presets_


@dataclass
class TrainConfig:
    # Float flags that may be nan or inf (a recipe's own choice, e.g. "no bound" as inf). Every other float flag is
    # refused for them at parsing: `--noise nan` made a run directory and failed at the first step. A plain class
    # attribute, not a field (no annotation): not a flag.
    non_finite_allowed = frozenset()

    preset: tyro.conf.Suppress[str | None] = None
    """The preset the defaults came from (set by parse_config from `--preset NAME`, not a flag of its own)."""
    output_dir: Path | None = None
    """Run directory. Default: runs/<recipe>/<run-name>, the name made on the main process and shared."""
    resume_from: Literal["auto"] | Path | None = None
    """`auto`: newest complete checkpoint of --output-dir (or of the newest run of this recipe when no
    --output-dir is given), a fresh start when there is none. PATH: a checkpoints/step_N dir or a run dir."""
    run_name: str | None = None
    """Name of the run (default: date-time); used for the default --output-dir and the tracker."""
    seed: int = 0
    """Seeds weights, data order, dropout and sampled negatives (0 .. 2**32 - 1)."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; learning-rate schedules then end there too."""
    batch_size: int = 128
    """GLOBAL batch size per forward pass, split evenly over the processes (must divide by their number).
    The effective batch per optimizer step is batch_size x grad_accum."""
    batch_per_process: int | None = None
    """Keep each process's batch fixed instead: the global --batch-size becomes N x the number of processes (seed
    000's "effective batch = batch x processes"), so adding processes adds samples per step. Give this or
    --batch-size, not both; config.json records both."""
    lr: float = 1e-3
    """Peak learning rate (with --scale-lr: the rate for the preset's batch, scaled to this run's)."""
    scale_lr: Literal["none", "linear", "sqrt"] = "none"
    """Scale every learning rate (--lr, and a recipe's other *_lr) with the samples per optimizer step against the
    preset's: linear (lr x batch / preset batch, seed 004's rule for Adam at moderate batches) or sqrt; config.json
    records the scaled rates. For --batch-per-process, whose global batch grows with the processes."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N optimizer steps (0 = only at epoch ends and at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest N complete checkpoints (the best-validation one is always kept too)."""
    eval_every: int = 1
    """Evaluate on the validation split every N epochs (and at the end)."""
    eval_every_steps: int = 0
    """Evaluate every N optimizer steps instead of every --eval-every epochs (0 = by epochs)."""
    log_every: int = 20
    """Read the training loss from the device every N optimizer steps (and at every evaluation and checkpoint):
    log it, check it is finite (a bad step stops the run within N steps; no checkpoint holds one), update the bar.
    On a GPU each read is a host sync: N keeps it under 1% of the steps' time."""
    deterministic: bool = False
    """Use deterministic algorithms (needed for bit-exact GPU runs; slower)."""
    log_with: Literal["wandb", "tensorboard", "csv", "none"] = "wandb"
    """Tracker. wandb runs offline by itself when no W&B credentials are found. csv writes log.csv."""
    wandb_project: str | None = None
    """W&B project (default: the recipe name)."""
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None
    """Overrides the accelerate config. bf16 works on CPU and GPU; fp16 needs a GPU."""
    num_workers: int = 0
    """DataLoader worker processes per process (the evaluation loaders; the training set's too with
    --no-data-on-device)."""
    data_on_device: bool = True
    """Keep the training set on the device and cut each batch there (toolkit.run.device_data): no workers, no copy per
    step, the same batches. Off, or when the set does not fit in half the device's free memory: a DataLoader."""
    threads: int = 0
    """Intra-op CPU threads of each process (torch.set_num_threads). 0 = the launcher's choice (OMP_NUM_THREADS,
    or Accelerate's physical cores / local processes). One process with many threads is seed 000's CPU-node mode."""
    kernels: Literal["auto", "plain"] = "auto"
    """auto: the model's fast paths (toolkit/kernels/: CPU products, attention with its backward written out, fused
    sequence kernels) are swapped in where they apply, after proving at the start, on one batch, that they compute
    what the model file's code computes (a difference is one line, exit 2). plain: exactly the code in the model file.
    They differ in rounding only, so a resume keeps the run's choice."""
    compile: bool = False
    """torch.compile the model (inductor)."""
    cuda_graphs: bool = False
    """On CUDA: capture the whole training step (forward, backward, optimizer) as one CUDA graph and replay it: a few
    launches where a step launched hundreds of kernels (with --compile, of the compiled model). Where a recipe or run
    cannot (several processes, --grad-accum, fp16, HRM), the model is compiled with its forward and backward
    captured instead (torch.compile mode="reduce-overhead"), said in one line. Refused on CPU."""
    dist_timeout: float = 600.0
    """Seconds a collective may wait for a lost or stuck rank before the run fails."""
    max_requeues: int = 3
    """On SIGUSR1 (pre-emption / time limit) the run checkpoints and requeues its SLURM job at most this often."""
    max_loss_ratio: float = 1e6
    """Stop the run (one line, like a non-finite loss) when a step's training loss exceeds this many times the first
    step's: a loss that explodes (e.g. --lr far too high) is not trained on. 0 = off."""

    # Not a flag (no annotation): True in a recipe whose step runs through loop.run_step, keyed on tensors only,
    # which --cuda-graphs captures whole (toolkit.run.step_graph)
    captures_whole_step = False


ConfigT = TypeVar("ConfigT", bound=TrainConfig)
CHECK_ARGS = "TOOLKIT_CHECK_ARGS"  # =1: parse and check the flags, then exit (0, or 2 with the one error line)


def parse_config(presets: type[ConfigT] | Mapping[str, tuple[str, ConfigT]], args: list[str] | None = None,
                 description: str | None = None, check: Callable[[ConfigT], None] | None = None) -> ConfigT:
    """Parse the command line; a bad flag exits 2 with ONE line naming it (tyro's box is condensed).
    presets: the recipe's {name: (one-line description, config)} (toolkit.run.presets; `--preset NAME` picks one, the
    first by default, and its values are the flags' defaults), or just a config dataclass.
    check(config): the recipe's own checks (raise UsageError), run here with the global batch known and before
    anything is made, so `toolkit sweep` checks every value of a grid with them before it starts a run."""
    is_main = os.environ.get("RANK", "0") == "0"
    args = sys.argv[1:] if args is None else list(args)
    if isinstance(presets, Mapping):
        name, args = presets_.split_preset(presets, args)
        # The usage line then reads `recipe.py --preset NAME [flags]`, the syntax the toolkit documents.
        prog = f"{Path(sys.argv[0]).name} {presets_.FLAG}"
        cli = dict(f=presets_.preset_type(presets, description), args=[name, *args], prog=prog,
                   default=presets_.named(presets, next(iter(presets))))
    else:
        cli = dict(f=presets, args=args, description=description)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            config = tyro.cli(**cli, console_outputs=is_main)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            if is_main:
                print(f"error: {_condense_tyro_error(captured.getvalue())}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    validate(config)
    _apply_batch_per_process(config, args)
    reference = presets_.named(presets, name) if isinstance(presets, Mapping) else presets()
    scaled = _apply_scale_lr(config, reference)
    if check is not None:
        check(config)
    if os.environ.get(CHECK_ARGS) == "1":  # `toolkit sweep` checks a grid's flags before it makes anything
        raise SystemExit(0)
    if scaled and is_main:
        print(scaled, flush=True)
    return config


def _apply_scale_lr(config: TrainConfig, reference: TrainConfig) -> str | None:
    """--scale-lr: multiply every learning-rate field (lr and any *_lr) by (samples per optimizer step / the
    preset's), or its square root; the line that says the effective rates, or None when nothing was scaled."""
    if config.scale_lr == "none":
        return None
    batch, base = config.batch_size * config.grad_accum, reference.batch_size * reference.grad_accum
    factor = batch / base if config.scale_lr == "linear" else math.sqrt(batch / base)
    names = [f.name for f in dataclasses.fields(config)
             if (f.name == "lr" or f.name.endswith("_lr")) and isinstance(getattr(config, f.name), float)]
    rates = []
    for name in names:
        given = getattr(config, name)
        setattr(config, name, given * factor)
        scaled = getattr(config, name)
        if not (math.isfinite(scaled) and scaled > 0):  # validate() saw the rate as given: this one trains
            raise UsageError(f"--{name.replace('_', '-')} {given:g} scaled by --scale-lr {config.scale_lr} "
                             f"(x {factor:g}) is {scaled:g}, which is invalid; the scaled rate must be a finite "
                             f"number > 0")
        rates.append(f"--{name.replace('_', '-')} {given:g} -> {getattr(config, name):g}")
    how = f"{batch} / {base}" if config.scale_lr == "linear" else f"sqrt({batch} / {base})"
    return (f"learning rate scaled ({config.scale_lr}, samples per optimizer step {batch} against the preset's {base}: "
            f"x {how} = {factor:g}): {', '.join(rates)}")


def _apply_batch_per_process(config: TrainConfig, args: list[str]) -> None:
    """--batch-per-process N: the global batch is N x the launcher's world size (WORLD_SIZE, 1 without a launcher),
    set here so that everything after parsing, the recipe's own checks included, sees the global batch."""
    if config.batch_per_process is None:
        return
    if config.batch_per_process < 1:
        raise UsageError(f"--batch-per-process {config.batch_per_process} is invalid; it must be a positive integer")
    if any(arg == "--batch-size" or arg.startswith("--batch-size=") for arg in args):
        raise UsageError("--batch-size and --batch-per-process were both given; give --batch-size (the global batch) "
                         "or --batch-per-process (each process's batch), not both")
    config.batch_size = config.batch_per_process * int(os.environ.get("WORLD_SIZE", "1") or 1)


def _condense_tyro_error(text: str) -> str:
    """tyro prints a box; keep its message lines (above the first rule) as one line."""
    lines = []
    for raw in text.splitlines():
        line = raw.strip().strip("│╭╮╰╯").strip()
        if line.startswith("─") or line.startswith("For full helptext"):
            if lines:
                break
            continue
        line = re.sub(r"^─+ [A-Za-z ]+ ─+$", "", line).strip()
        if line:
            lines.append(line)
    return " ".join(lines) or text.strip().replace("\n", " ")


def require_at_least(config: TrainConfig, minimum: int, *names: str) -> None:
    """A recipe's integer flags `names` must be >= minimum: otherwise one UsageError line naming the flag."""
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid; it must be >= {minimum}")


def require_range(config: TrainConfig, interval: str, *names: str) -> None:
    """A recipe's number flags `names` must lie in `interval`, written as in mathematics ("[0, 1)", "(0, 1]"):
    otherwise one UsageError line naming the flag and the interval (NaN is in no interval)."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    for name in names:
        value = getattr(config, name)
        above = value >= low if interval[0] == "[" else value > low
        below = value <= high if interval[-1] == "]" else value < high
        if not (above and below):
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid; it must be in {interval}")


def require_finite(config: TrainConfig, *names: str, above: float = 0, inclusive: bool = True) -> None:
    """A recipe's number flags `names` must be finite and >= `above` (> with inclusive=False): otherwise one
    UsageError line naming the flag."""
    for name in names:
        value = getattr(config, name)
        if not (math.isfinite(value) and (value >= above if inclusive else value > above)):
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid; it must be a finite number "
                             f"{'>=' if inclusive else '>'} {above:g}")


def validate(config: TrainConfig) -> None:
    """Range checks tyro cannot express, before any expensive work."""
    positive = ["epochs", "batch_size", "grad_accum", "keep_checkpoints", "eval_every", "log_every"]
    for name in positive:
        value = getattr(config, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid; it must be a positive integer")
    if config.max_steps is not None and config.max_steps < 1:
        raise UsageError(f"--max-steps {config.max_steps} is invalid; give a positive number of steps or omit it")
    if not 0 <= config.seed < 2**32:
        raise UsageError(f"--seed {config.seed} is invalid; give an integer in 0 .. {2**32 - 1}")
    for name in ["checkpoint_every", "num_workers", "max_requeues", "eval_every_steps", "threads"]:
        if getattr(config, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(config, name)} is invalid; it must be >= 0")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise UsageError(f"--lr {config.lr} is invalid; it must be a finite number > 0")
    if not (config.max_grad_norm >= 0 and math.isfinite(config.max_grad_norm)):
        raise UsageError(f"--max-grad-norm {config.max_grad_norm} is invalid; use 0 (off) or a positive norm")
    if config.output_dir is not None and str(config.output_dir) in ("", "."):
        raise UsageError(f"--output-dir {str(config.output_dir)!r} is the current directory; give a directory for "
                         "this run (e.g. runs/my-run)")
    if not (config.dist_timeout > 0 and math.isfinite(config.dist_timeout)):
        raise UsageError(f"--dist-timeout {config.dist_timeout} is invalid; give seconds > 0")
    if not (config.max_loss_ratio == 0 or (config.max_loss_ratio > 1 and math.isfinite(config.max_loss_ratio))):
        raise UsageError(f"--max-loss-ratio {config.max_loss_ratio} is invalid; give a number > 1, or 0 for off")
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value) and field.name not in config.non_finite_allowed:
            raise UsageError(f"--{field.name.replace('_', '-')} {value} is invalid; it must be a finite number")


# Flags that may differ when a run is resumed: they change how long it runs, what it logs, where and how often it
# saves, how it waits; never what a step computes. Any other change is refused, so a new config field is refused
# until it is named here; naming one here needs a changed value in tests/test_resume_rule.py (RESUME_CHANGES), whose
# resume of every recipe with all of them changed must stay bit-identical to the uninterrupted run.
RESUMABLE_CHANGES = {
    "epochs", "max_steps", "log_every", "log_with", "wandb_project", "checkpoint_every", "keep_checkpoints",
    "dist_timeout", "num_workers", "max_requeues", "max_loss_ratio", "output_dir", "resume_from", "run_name",
    "cache_dir", "data_on_device",
}


# Shared flags added after runs were made, with the value that reproduces what those runs did: a run whose
# config.json lacks one resumes with that value as if it had been given (any other value is a change, refused as
# usual). A recipe's own added flags are its config class's `added_flags` (a plain class attribute, not a field);
# config.json records both (ADDED_FLAGS_KEY), so that `verify` compares a run's settings without its recipe.
ADDED_FLAGS = {
    "kernels": "auto",
    "scale_lr": "none",
}
ADDED_FLAGS_KEY = "added_flags"


def added_flags(config: TrainConfig | type[TrainConfig]) -> dict:
    """ADDED_FLAGS and the `added_flags` of the recipe's config class (and of its bases)."""
    cls = config if isinstance(config, type) else type(config)
    merged = dict(ADDED_FLAGS)
    for base in reversed(cls.__mro__):
        merged.update(vars(base).get("added_flags", {}))
    return merged


def changed_flags(old: dict, new: dict, added: Mapping | None = None) -> list[str]:
    """The flags that differ between two configs (config.json's "config"), as "--lr 0.001 -> 0.1", those a resume
    may change aside. `added`: the flags added since, with the values that reproduce older runs (`added_flags`;
    default ADDED_FLAGS, the shared ones)."""
    if "preset" not in old or old["preset"] is None:
        # A run made before its recipe had presets ran with the values of today's default one; its other flags are
        # compared one by one all the same.
        old = {**old, "preset": new.get("preset")}
    old = {**{key: value for key, value in (ADDED_FLAGS if added is None else added).items() if key in new}, **old}
    return [f"--{key.replace('_', '-')} {old.get(key)!r} -> {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]
