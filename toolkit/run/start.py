"""Start a run: process group, Accelerator, run directory, resume point, config.json and trackers.

Handles the Accelerate traps once (REFERENCE.md §1): a CPU-only machine gets a cpu-mode Accelerator so a
multi-process launch is a real gloo run; fp16 on CPU (silently fp32 in Accelerate) is refused; batches are
split from one GLOBAL batch (split_batches) with the seedable sampler and one shared data seed, so N processes
see exactly the batches one process would; the timeout reaches the first PartialState.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import inspect
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
import unicodedata
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import accelerate.optimizer
import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    broadcast_object_list,
    set_seed,
)

from toolkit import kernels
from toolkit.console import write_line
from toolkit.errors import ONE_LINE, UsageError, same_failure
from toolkit.process import extras, heap, openmp, orphans, preemption, shutdown
from toolkit.run import checkpoint, compilation, precision, step_graph
from toolkit.run.accelerator import ToolkitAccelerator
from toolkit.run.config import ADDED_FLAGS_KEY, RESUMABLE_CHANGES, TrainConfig, added_flags, changed_flags  # noqa: F401  (RESUMABLE_CHANGES: tests read it here)
from toolkit.run.devices import runs_on_cpu
from toolkit.run.distributed import watch_peers
from toolkit.run.rundir import CONFIG_FILE, LOG_FILE, METRICS_FILE
from toolkit.run.tracking import tracker_choice, tracker_init_kwargs

# Accelerate's optimizer asks importlib whether lomo_optim is installed twice in every step() (two find_spec calls,
# ~40 us a step: a third of the toolkit's cost on the UFS MLP's 1.3 ms step, benchmarks/overhead.py). What is
# installed does not change during a run: asked once.
accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)


@functools.cache
def _signature_of_function(function) -> inspect.Signature:
    return inspect.signature(function)


# Its zero_grad also calls inspect.signature(optimizer.zero_grad) in every step (~25 us, to see whether it takes
# set_to_none; its module's only use of `inspect`). A method's signature does not change: asked once per function
# (the unbound function's signature has the same parameter names, self aside).
accelerate.optimizer.inspect = types.SimpleNamespace(
    signature=lambda method: _signature_of_function(getattr(method, "__func__", method))
)

RUNS_ROOT = Path("runs")

DEAD_LIFE_FILES = (METRICS_FILE, LOG_FILE)  # rows a life writes before its first checkpoint


@dataclass
class Run:
    """A started run, and the owner of its life: `with start_run(cfg, recipe=...) as run:`. The process group and
    Accelerator exist, the run directory and resume point are chosen, but nothing is written until `begin()` (called
    by TrainingLoop.start(): the lock, config.json, the trackers), so bad input found while the recipe prepares its
    data and model leaves nothing behind; the end of the block ends the process group on every path."""

    accelerator: Accelerator
    config: TrainConfig
    recipe: str
    output_dir: Path
    run_name: str
    run_id: str
    resume_checkpoint: Path | None
    previous: dict | None = None  # the resumed run's config.json
    resume_step: int = 0
    extra_info: dict = dataclasses.field(default_factory=dict)
    begun: bool = False
    ended: bool = False
    whole_step_graphs: bool = False  # --cuda-graphs captures the whole step (toolkit.run.step_graph), not the model's

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """`with start_run(cfg, recipe=...) as run:` ends the run on every path: a normal end leaves together (end);
        a failure every rank shares (bad input, an agreed stop, a pre-emption) releases what runs without waiting
        for the others. A failure that may have broken the process group (a lost peer, a bug) is left to
        one_line_errors and the exit hook (toolkit.process.shutdown): they first name the lost rank from the
        heartbeat, which
        releasing here would stop, and never destroy a broken group."""
        try:
            if error is None:
                self.end()
            elif not shutdown.breaks_group(error):
                shutdown.release()
        finally:
            preemption.restore_handlers()  # the process that ran it (a test, a sweep) gets its own SIGTERM back

    def end(self) -> None:
        """The normal end, on every rank (a collective): the ranks meet, the trackers and the process group end.
        Once; TrainingLoop.finish() calls it, and so does the end of the `with` block."""
        if not self.ended:
            self.ended = True
            shutdown.end_process_group(self.accelerator)

    @property
    def model_graphs(self) -> bool:
        """--cuda-graphs capturing the compiled model's forward and backward (torch.compile mode="reduce-overhead"),
        where the whole step cannot be one graph."""
        return self.config.cuda_graphs and not self.whole_step_graphs

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def print(self, *args) -> None:
        """Print on the main process only."""
        self.accelerator.print(*args, flush=True)

    def with_kernels(self, model: torch.nn.Module, example) -> torch.nn.Module:
        """The model with its fast paths swapped in under --kernels auto, proven at this start to compute what the
        model file's code computes (toolkit.kernels): `example(model)` runs one batch of a few samples at the model's
        own sizes, which this call puts on the run's device and runs under its autocast. Before the loop starts, so
        that a difference stops the run (one line, exit 2, on every rank) before its directory is made. Says which
        modules were swapped."""
        model.to(self.accelerator.device)
        problem, swapped = None, []
        try:
            swapped = kernels.with_kernels(model, self.config.kernels, example, autocast=self.accelerator.autocast)
        except UsageError as error:
            problem = error
        _raise_if_any(self.accelerator, problem)
        if swapped:
            fast = sorted({f"{type(module).__module__}.{type(module).__qualname__}"
                           for name, module in model.named_modules() if (name or type(model).__name__) in swapped})
            self.print(f"kernels: {', '.join(fast)}, proven equal to the model's code on one batch "
                       "(--kernels plain trains the model's code alone)")
        return model

    def write_artifact(self, name: str, write) -> Path | None:
        """RUN_DIR/name written by the main process only (a plot, an export): write(path) is called there with a
        temporary sibling path, renamed to `name` when it returns, so a reader never sees half a file. Compute
        what it needs on every rank first (gathers are collectives); the other ranks only get the path. None when
        an optional package it needs is missing (one line names the pip command; the run's results stand)."""
        path = self.output_dir / name
        if self.is_main:
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial{path.suffix}")
            try:
                write(partial)
                partial.replace(path)
            except extras.MissingExtra as missing:
                self.print(f"{name} not written: {missing}")
                return None
            except OSError as error:  # a full disk: one line naming it
                raise checkpoint.disk_error(error, path) from None
            finally:
                partial.unlink(missing_ok=True)
        return path

    def describe_data(self, fingerprint: str, **info) -> None:
        """Record what the run trains on (config.json's "data"). On resume, a different fingerprint (another file,
        or the same file changed) is refused: the batches skipped on resume would be the wrong ones."""
        before = (self.previous or {}).get("data", {}).get("fingerprint")
        if before is not None and before != fingerprint:
            raise UsageError(
                f"the data changed since the run in {self.output_dir} was started (fingerprint {before} -> "
                f"{fingerprint}); resume with the same data, or start a new run with another --output-dir"
            )
        self.extra_info["data"] = {"fingerprint": fingerprint, **info}

    def begin(self) -> None:
        """Take the run directory: lock it (main process, for the life of the process), write config.json, start
        the trackers. Every rank then checks that it sees the same directory (a filesystem shared by all machines)."""
        if self.begun:
            return
        self.begun = True
        accelerator = self.accelerator
        problem = [None]
        if self.is_main:
            try:
                _take_run_dir(self)
            except ONE_LINE as error:  # bad input, or a disk that cannot be written: every rank stops with it
                problem[0] = error
        accelerator.wait_for_everyone()
        if problem[0] is None and not self.is_main and os.environ.get("LOCAL_RANK", "0") == "0":
            problem[0] = _shared_filesystem_problem(self)
        _raise_if_any(accelerator, problem[0])
        if self.config.compile or self.config.cuda_graphs:  # inductor's caches into the run dir (every rank, before
            # the first step compiles)
            compilation.use_run_cache(self.output_dir)
        if accelerator.log_with:
            accelerator.init_trackers(
                self.config.wandb_project or self.recipe,
                config=_flat_config(self),
                init_kwargs=tracker_init_kwargs(self.output_dir, self.run_name, self.run_id),
            )


def start_run(config: TrainConfig, recipe: str, extra_info: dict | None = None, *,
              ddp_kwargs: dict | None = None, accelerator_kwargs: dict | None = None) -> Run:
    """Form the process group, build the Accelerator, choose the run directory and resume point (writing nothing).

    ddp_kwargs: passed to DDP (DistributedDataParallelKwargs, e.g. broadcast_buffers=False);
    accelerator_kwargs: further Accelerator(...) arguments.
    """
    orphans.stop_when_launcher_dies()  # each once per process: begin_process() may have done them already
    shutdown.release_at_exit()
    heap.keep_between_steps()  # freed memory stays for the next step (toolkit.process.heap), before the data is made
    use_cpu = runs_on_cpu()  # also honours a CPU launch config on a GPU machine
    timeout = timedelta(seconds=config.dist_timeout)
    if config.deterministic:  # cuBLAS needs this before CUDA starts, or use_deterministic_algorithms raises
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The process group first (with our timeout), so the main process can choose the run dir and share it.
    shutdown.before_process_group()  # so that the group, its threads and the heartbeat end before the interpreter
    state = PartialState(cpu=use_cpu, timeout=timeout)
    _check_machines_agree(state)
    if config.batch_size % state.num_processes:
        raise UsageError(
            f"--batch-size {config.batch_size} is not divisible by the {state.num_processes} processes; "
            f"give a multiple of {state.num_processes} (it is the GLOBAL batch, split over processes)"
        )
    output_dir, resume_checkpoint, run_name, fresh_id, previous, warnings = _shared(
        state, lambda: _resolve_run_dir(config, recipe, state.num_processes)
    )
    run_id, resume_step = fresh_id, 0
    if resume_checkpoint is not None:
        saved = checkpoint.read_progress(resume_checkpoint)
        run_id, resume_step = saved.get("run_id", fresh_id), int(saved["global_step"])

    handlers = [InitProcessGroupKwargs(timeout=timeout)]
    if ddp_kwargs:
        handlers.append(DistributedDataParallelKwargs(**ddp_kwargs))
    compiling = config.compile or config.cuda_graphs
    accelerator = (compilation.CompilingAccelerator if compiling else ToolkitAccelerator)(
        **({"compile_mode": "reduce-overhead"} if config.cuda_graphs else {}),
        cpu=use_cpu,
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.grad_accum,
        dataloader_config=DataLoaderConfiguration(
            split_batches=True, even_batches=True, use_seedable_sampler=True, data_seed=config.seed
        ),
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard")),
        log_with=tracker_choice(config.log_with, output_dir, state.is_main_process),
        kwargs_handlers=handlers,
        **(accelerator_kwargs or {}),
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UsageError(
            "--mixed-precision fp16 (or the accelerate config's fp16) needs a GPU: on CPU Accelerate would silently "
            "train in fp32; use --mixed-precision bf16 or no"
        )
    if config.cuda_graphs and accelerator.device.type != "cuda":
        raise UsageError(f"--cuda-graphs needs a CUDA device; this run is on {accelerator.device.type}: drop the flag "
                         "(--compile compiles on any device)")
    graphs_refused = None
    if config.cuda_graphs:
        graphs_refused = step_graph.whole_step_refusal(config, num_processes=accelerator.num_processes,
                                                       mixed_precision=accelerator.mixed_precision)
        if graphs_refused is None:  # the whole step is one graph: the model is compiled only for --compile
            accelerator.compile_mode, accelerator.compiles = None, config.compile
    if config.threads:  # after the Accelerator: it may have set its own thread count
        torch.set_num_threads(config.threads)
    slow_bf16 = None
    if accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu" and accelerator.is_main_process:
        slow_bf16 = precision.bf16_warning()  # measured with this process's threads, before any seed is set
    set_seed(config.seed, deterministic=config.deterministic)
    preemption.install_handler()

    run = Run(accelerator, config, recipe, output_dir, run_name, run_id, resume_checkpoint, previous, resume_step,
              dict(extra_info or {}), whole_step_graphs=config.cuda_graphs and graphs_refused is None)
    watch_peers(accelerator.process_index, accelerator.num_processes, output_dir)
    _announce_rank(accelerator)
    wait_policy = openmp.wait_policy_line(torch.get_num_threads())
    graphs_line = step_graph.refusal_line(graphs_refused) if graphs_refused else None
    for line in [*warnings, *([slow_bf16] if slow_bf16 else []), *([wait_policy] if wait_policy else []),
                 *([graphs_line] if graphs_line else [])]:
        run.print(line)
    where = f"resuming from {resume_checkpoint}" if resume_checkpoint else "fresh start"
    run.print(f"run {run_name}: {output_dir} ({where}); {accelerator.num_processes} process(es), {accelerator.device}")
    if previous is not None and previous.get("world_size") != accelerator.num_processes:
        run.print(f"resuming with {accelerator.num_processes} process(es) where the run had "
                  f"{previous.get('world_size')}: the global batch ({config.batch_size}) is unchanged, and config.json "
                  "records the change")
    return run


def _raise_if_any(accelerator: Accelerator, problem: Exception | str | None) -> None:
    """Every rank raises the first rank's problem (rank order), so all stop together with the same line."""
    if accelerator.num_processes == 1:
        if problem:
            raise same_failure(problem)
        return
    import torch.distributed as dist

    problems: list = [None] * accelerator.num_processes
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise same_failure(first)


def _check_machines_agree(state: PartialState) -> None:
    """torchrun forms a group even when machines were launched with different --num_processes (it just adds
    them up): a silently odd world size. Every machine must run the same number of processes."""
    if state.num_processes == 1:
        return
    import torch.distributed as dist

    mine = (int(os.environ.get("GROUP_RANK", "0") or 0), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    views: list = [None] * state.num_processes
    dist.all_gather_object(views, mine)
    per_machine = dict(views)
    if len(set(per_machine.values())) > 1:
        counts = ", ".join(f"machine {m}: {n}" for m, n in sorted(per_machine.items()))
        raise UsageError(
            f"the machines were launched with different process counts ({counts}; world size "
            f"{state.num_processes}); give every machine the same --num_processes and --num_machines"
        )


def _shared(state: PartialState, make):
    """Compute on the main process, hand the result (or its UsageError) to every rank."""
    box = [None]
    if state.is_main_process:
        try:
            box[0] = ("ok", make())
        except ONE_LINE as error:
            box[0] = ("error", error)
    if state.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    kind, value = box[0]
    if kind == "error":
        raise same_failure(value)
    return value




def _resolve_run_dir(config: TrainConfig, recipe: str, world_size: int):
    """(output_dir, checkpoint to resume or None, run name, a fresh run id, the resumed run's config.json, lines to
    print). Checks everything it can without writing: the directory, its lock, the checkpoint, the flags."""
    _check_control_characters(config)
    run_id = secrets.token_hex(4)
    default_name = config.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}"
    output_dir = Path(config.output_dir) if config.output_dir is not None else None
    if output_dir is not None:
        _check_output_dir(output_dir)
    resume = config.resume_from
    warnings: list[str] = []
    if resume == "auto":
        if output_dir is None:
            output_dir = _newest_resumable_run(RUNS_ROOT / recipe, config, say=warnings.append)
        found = None
        entries = checkpoint.step_entries(output_dir) if output_dir is not None else []
        if entries and (checkpoint.newest_complete(output_dir) is not None or any(not p.is_dir() for p in entries)):
            _check_not_locked(output_dir)
            found = checkpoint.newest_intact(output_dir, say=warnings.append)
            if found is None:  # each entry, newest first, with what is wrong with it
                shown = "; ".join(f"{p.name}: {checkpoint.why_not_intact(p)}" for p in entries[::-1][:3])
                raise UsageError(f"--resume-from auto: no checkpoint in {output_dir}/checkpoints can be resumed from "
                                 f"({shown}); nothing was changed: restore or remove them, or start a new run with "
                                 "another --output-dir")
        if found is not None:
            _check_settings_record(found, output_dir)
            previous = _previous_config(output_dir, config)
            return output_dir, found, output_dir.name, run_id, previous, warnings
        output_dir = output_dir or RUNS_ROOT / recipe / default_name
        # A fresh start under `auto` may land in a directory whose run died before its first checkpoint: it starts
        # that run afresh, and _take_run_dir empties the rows the dead life wrote (an uninterrupted run's files).
        _check_not_locked(output_dir)
        dead = [name for name in DEAD_LIFE_FILES if (output_dir / name).exists()]
        if dead:
            warnings.append(f"{output_dir} holds a run that stopped before its first checkpoint: starting it afresh "
                            f"({' and '.join(dead)} of that life are removed)")
        return output_dir, None, output_dir.name, run_id, None, warnings
    if resume is not None:
        found = checkpoint.resolve_checkpoint_path(Path(resume))
        if output_dir is None:
            output_dir = found.parent.parent
        _check_not_locked(output_dir)
        _check_settings_record(found, found.parent.parent)
        return output_dir, found, output_dir.name, run_id, _previous_config(found.parent.parent, config), warnings
    output_dir = output_dir or RUNS_ROOT / recipe / default_name
    if checkpoint.checkpoints_root(output_dir).exists() or any(
            (output_dir / name).exists() for name in (CONFIG_FILE, *DEAD_LIFE_FILES)):
        raise UsageError(
            f"--output-dir {output_dir} already holds a run; continue it with --resume-from auto "
            "or choose another --output-dir (nothing there is overwritten)"
        )
    _check_not_locked(output_dir)
    return output_dir, None, output_dir.name, run_id, None, warnings


def _check_control_characters(config: TrainConfig) -> None:
    """A path (or the run name, which names a directory) with a control character in it (a newline, a tab, an
    escape) is a pasting accident: it would make a directory no one can type, and split the one-line messages."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, Path) or (field.name == "run_name" and isinstance(value, str)):
            bad = next((c for c in str(value) if unicodedata.category(c) == "Cc"), None)
            if bad is not None:
                raise UsageError(f"--{field.name.replace('_', '-')} {str(value)!r} holds a control character "
                                 f"({bad!r}); give it without control characters (newlines, tabs, escapes)")


def _check_settings_record(found: Path, run_dir: Path) -> None:
    """The run's config.json must say what the checkpoint recorded it ran with: flags are compared with
    config.json, so an edited config.json would let a resume change what a step computes."""
    changes = checkpoint.settings_changes(found, _readable_config_json(run_dir))
    if changes:
        raise UsageError(f"cannot resume from {found}: {run_dir}/{CONFIG_FILE} differs from the settings that "
                         f"checkpoint was saved with ({'; '.join(changes)}); {CONFIG_FILE} was changed after the "
                         "save: restore those values in it, or start a new run with another --output-dir")


def _check_output_dir(output_dir: Path) -> None:
    if str(output_dir) in ("", "."):
        raise UsageError(f"--output-dir {str(output_dir)!r} is the current directory; give a directory for this run "
                         "(e.g. runs/my-run)")
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} is a file, not a directory; give a directory for this run")
    ancestor = output_dir
    while not ancestor.exists():
        if ancestor.is_symlink():  # a symbolic link whose target does not exist: mkdir would say "File exists"
            raise UsageError(f"--output-dir {output_dir}: {ancestor} is a symbolic link to {os.readlink(ancestor)}, "
                             "which does not exist; create its target or give another --output-dir")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--output-dir {output_dir}: {ancestor} is a file, so the directory cannot be made")
    try:  # a real write (root ignores permission bits): create and remove a probe, leaving the tree as it was
        fd, probe = tempfile.mkstemp(prefix=".toolkit-probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UsageError(f"--output-dir {output_dir} is not writable ({error.strerror} in {ancestor}); "
                         "give a writable directory") from None


def config_values(config: TrainConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _read_config_json(run_dir: Path) -> dict | None:
    """The run's config.json, or the newest config.previous-N.json if a life died between the two renames."""
    candidates = [run_dir / CONFIG_FILE, *sorted(run_dir.glob("config.previous-*.json"),
                                                 key=lambda p: int(p.stem.rsplit("-", 1)[-1]), reverse=True)]
    for path in candidates:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def _readable_config_json(run_dir: Path) -> dict:
    """The resumed run's config.json with its settings, or one line saying that it is missing or unreadable (not
    that it differs: an absent file has no values to compare)."""
    previous = _read_config_json(run_dir)
    if not isinstance(previous, dict) or not isinstance(previous.get("config"), dict):
        raise UsageError(f"--resume-from: {run_dir}/{CONFIG_FILE} is missing or unreadable, so the run's settings "
                         "cannot be checked; restore it or start a new run")
    return previous


def _previous_config(run_dir: Path, config: TrainConfig) -> dict:
    """The resumed run's config.json; refuses flags that changed what a step computes."""
    previous = _readable_config_json(run_dir)
    changed = changed_flags(previous["config"], config_values(config), added_flags(config))
    if changed:
        raise UsageError(f"cannot resume {run_dir} with changed settings: {'; '.join(changed)}; use the run's "
                         f"values (see its {CONFIG_FILE}) or start a new run with another --output-dir")
    return previous


def _newest_resumable_run(recipe_root: Path, config: TrainConfig, say=None) -> Path | None:
    """The newest run of this recipe with a complete checkpoint AND the same settings (flags that may change on
    resume aside): `--resume-from auto` never continues a run of another configuration. When the newest run with a
    checkpoint has other settings, `say` gets one line naming the flags that differ (a fresh run starts)."""
    if not recipe_root.is_dir():
        return None
    new = config_values(config)
    runs, others = [], []
    for path in recipe_root.iterdir():
        newest = checkpoint.newest_complete(path) if path.is_dir() else None
        previous = _read_config_json(path) if newest is not None else None
        if not (previous and isinstance(previous.get("config"), dict)):
            continue
        changed = changed_flags(previous["config"], new, added_flags(config))
        (others if changed else runs).append((newest.stat().st_mtime, str(path), changed))
    if others and say is not None and (not runs or max(others) > max(runs)):
        _, newest_other, changed = max(others)
        shown = "; ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        say(f"--resume-from auto: the newest run with a checkpoint, {newest_other}, has other settings ({shown}); "
            + ("starting a new run" if not runs else f"resuming the newest run with these settings, "
               f"{max(runs)[1]}") + f" (to continue it, give --output-dir {newest_other} and its settings)")
    return Path(max(runs)[1]) if runs else None


# ---- the run directory's lock: one live run per directory ------------------------------------------------------

LOCK_FILE = ".lock"
_held_lock = None  # the open lock file of this process (the kernel releases the lock when the process dies)


def _lock_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock ("host H pid P"), or None when nobody does."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process"
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _check_not_locked(run_dir: Path) -> None:
    holder = _lock_holder(run_dir)
    if holder:
        raise UsageError(f"{run_dir} is in use by a live run ({holder}); wait for it to end or stop it, "
                         "or use another --output-dir")


def _take_run_dir(run: Run) -> None:
    """Main process: make the directory, lock it for the life of this process, write config.json."""
    global _held_lock
    try:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run.output_dir / LOCK_FILE, "a+")
    except OSError as error:
        raise checkpoint.disk_error(error, run.output_dir) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(f"{run.output_dir} is in use by a live run ({holder}); wait for it to end or stop it, "
                         "or use another --output-dir") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        handle.flush()
    except OSError as error:  # a full disk: even the lock's one line does not fit
        with contextlib.suppress(OSError):
            handle.close()  # its flush fails again; the file is closed all the same
        raise checkpoint.disk_error(error, run.output_dir / LOCK_FILE) from None
    _held_lock = handle
    try:
        # The lock proves no live run writes here: what saves and prunes of a dead life left behind goes now, so a
        # resumed run that ends before its first save still leaves a directory that verifies.
        for leftover, why in checkpoint.leftovers(run.output_dir):
            print(f"removing {leftover.relative_to(run.output_dir)}: {why}", flush=True)
            shutil.rmtree(leftover)
        if run.resume_checkpoint is None:  # a fresh start over a life that died before its first checkpoint
            for name in DEAD_LIFE_FILES:  # removed, not emptied: their writers start a new file with its header
                (run.output_dir / name).unlink(missing_ok=True)
        _write_config_json(run)
    except OSError as error:
        raise checkpoint.disk_error(error, run.output_dir / CONFIG_FILE) from None


def _shared_filesystem_problem(run: Run) -> str | None:
    """Checkpoints are written by every rank into one directory that the main process renames: every machine
    must see the main process's run directory. Checked by reading the run id it just wrote."""
    try:
        seen = json.loads((run.output_dir / CONFIG_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        seen = None
    if seen == run.run_id:
        return None
    return (f"machine {os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '?'))} ({socket.gethostname()}) "
            f"does not see the run directory {run.output_dir} that the main process writes: multi-node runs need "
            "--output-dir on a filesystem shared by all machines (NFS, Lustre, ...)")


def _announce_rank(accelerator: Accelerator) -> None:
    # Every rank says what it sees: tests (and people) read the world size from inside the processes.
    backend = accelerator.state.backend or "none"
    write_line(
        f"[rank {accelerator.process_index}/{accelerator.num_processes}] host={socket.gethostname()} "
        f"node_rank={os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))} device={accelerator.device} "
        f"backend={backend} mixed_precision={accelerator.mixed_precision} threads={torch.get_num_threads()}"
    )


def _flat_config(run: Run) -> dict:
    values = {}
    for key, value in dataclasses.asdict(run.config).items():
        values[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    values["world_size"] = run.accelerator.num_processes
    return values


def _write_config_json(run: Run) -> None:
    accelerator = run.accelerator
    world_sizes = [{"from_step": 0, "world_size": accelerator.num_processes}]
    if run.previous is not None:  # a resume: the process count may change (recorded here), nothing else may
        first = {"from_step": 0, "world_size": run.previous.get("world_size")}
        world_sizes = run.previous.get("world_sizes") or [first]
        world_sizes = [w for w in world_sizes if w["from_step"] < run.resume_step] or world_sizes[:1]
        if world_sizes[-1]["world_size"] != accelerator.num_processes:
            world_sizes.append({"from_step": run.resume_step, "world_size": accelerator.num_processes})
    info = {
        "recipe": run.recipe,
        "run_name": run.run_name,
        "run_id": run.run_id,
        "config": config_values(run.config),
        ADDED_FLAGS_KEY: added_flags(run.config),
        "world_size": accelerator.num_processes,
        "world_sizes": world_sizes,
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", "1")) or 1),
        "backend": accelerator.state.backend,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "device_name": torch.cuda.get_device_name() if accelerator.device.type == "cuda" else "cpu",
        "mixed_precision": accelerator.mixed_precision,
        "threads": torch.get_num_threads(),  # in effect in each process (--threads, else the launcher's choice)
        "resumed_from": str(run.resume_checkpoint) if run.resume_checkpoint else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "versions": _versions(),
        "git_commit": _git_commit(),
        **run.extra_info,
    }
    # The new file is written completely first; only then is the earlier life's config.json moved aside.
    path = run.output_dir / CONFIG_FILE
    fresh = run.output_dir / f".{CONFIG_FILE}.{os.getpid()}.tmp"
    try:
        fresh.write_text(json.dumps(info, indent=2, default=str) + "\n")
    except OSError:
        fresh.unlink(missing_ok=True)
        raise
    if path.exists():  # a resume: keep what the earlier life recorded
        previous = sorted(run.output_dir.glob("config.previous-*.json"))
        path.rename(run.output_dir / f"config.previous-{len(previous) + 1}.json")
    fresh.replace(path)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for name in ["torch", "accelerate", "datasets", "wandb", "tyro", "numpy"]:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main_process_first(run: Run, build):
    """Run `build` on the main process first (e.g. download and cache data), then on the others (load the cache).

    Unlike a bare `with accelerator.main_process_first()`, a UsageError on the main process reaches every rank
    at once instead of leaving the others waiting at the barrier until the timeout.
    """
    state = run.accelerator.state
    value, failure = None, [None]
    if state.is_main_process:
        try:
            value = build()
        except ONE_LINE as error:
            failure[0] = error
    if state.num_processes > 1:
        broadcast_object_list(failure, from_process=0)
    if failure[0] is not None:
        raise same_failure(failure[0])
    return value if state.is_main_process else build()
