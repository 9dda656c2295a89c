"""Start a run: process group, Accelerator, run directory, resume point, config.json and trackers.

Handles the Accelerate traps once (REFERENCE.md §1): a CPU-only machine gets a cpu-mode Accelerator so a
multi-process launch is a real gloo run; fp16 on CPU (silently fp32 in Accelerate) is refused; batches are
split from one GLOBAL batch (split_batches) with the seedable sampler and one shared data seed, so N processes
see exactly the batches one process would; the timeout reaches the first PartialState.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, broadcast_object_list, set_seed

from toolkit import checkpoint, preemption
from toolkit.config import TrainConfig
from toolkit.distributed import watch_peers
from toolkit.errors import UsageError
from toolkit.tracking import tracker_choice, tracker_init_kwargs, write_json

RUNS_ROOT = Path("runs")


@dataclass
class Run:
    accelerator: Accelerator
    config: TrainConfig
    recipe: str
    output_dir: Path
    run_name: str
    run_id: str
    resume_checkpoint: Path | None

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def print(self, *args) -> None:
        """Print on the main process only."""
        self.accelerator.print(*args, flush=True)


def start_run(config: TrainConfig, recipe: str, extra_info: dict | None = None) -> Run:
    use_cpu = not torch.cuda.is_available()
    timeout = timedelta(seconds=config.dist_timeout)
    # The process group first (with our timeout), so the main process can choose the run dir and share it.
    state = PartialState(cpu=use_cpu, timeout=timeout)
    _check_machines_agree(state)
    if config.batch_size % state.num_processes:
        raise UsageError(
            f"--batch-size {config.batch_size} is not divisible by the {state.num_processes} processes; "
            f"give a multiple of {state.num_processes} (it is the GLOBAL batch, split over processes)"
        )
    output_dir, resume_checkpoint, run_name, fresh_id = _shared(state, lambda: _resolve_run_dir(config, recipe))
    run_id = fresh_id
    if resume_checkpoint is not None:
        run_id = checkpoint.read_progress(resume_checkpoint).get("run_id", fresh_id)

    accelerator = Accelerator(
        cpu=use_cpu,
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.grad_accum,
        dataloader_config=DataLoaderConfiguration(
            split_batches=True, even_batches=True, use_seedable_sampler=True, data_seed=config.seed
        ),
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard")),
        log_with=tracker_choice(config.log_with, output_dir, state.is_main_process),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
        dynamo_backend="inductor" if config.compile else None,
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UsageError(
            "--mixed-precision fp16 (or the accelerate config's fp16) needs a GPU: on CPU Accelerate would silently "
            "train in fp32; use --mixed-precision bf16 or no"
        )
    set_seed(config.seed, deterministic=config.deterministic)
    preemption.install_handler()

    run = Run(accelerator, config, recipe, output_dir, run_name, run_id, resume_checkpoint)
    watch_peers(accelerator.process_index, accelerator.num_processes, output_dir)
    _announce_rank(accelerator)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        _write_config_json(run, extra_info or {})
    accelerator.wait_for_everyone()
    if accelerator.log_with:
        accelerator.init_trackers(
            config.wandb_project or recipe,
            config=_flat_config(run),
            init_kwargs=tracker_init_kwargs(output_dir, run_name, run_id),
        )
    where = f"resuming from {resume_checkpoint}" if resume_checkpoint else "fresh start"
    run.print(f"run {run_name}: {output_dir} ({where}); {accelerator.num_processes} process(es), {accelerator.device}")
    return run


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
        except UsageError as error:
            box[0] = ("error", str(error))
    if state.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    kind, value = box[0]
    if kind == "error":
        raise UsageError(value)
    return value


def _resolve_run_dir(config: TrainConfig, recipe: str) -> tuple[Path, Path | None, str, str]:
    """(output_dir, checkpoint to resume or None, run name, a fresh run id)."""
    run_id = secrets.token_hex(4)
    default_name = config.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}"
    output_dir = Path(config.output_dir) if config.output_dir is not None else None
    resume = config.resume_from
    if resume == "auto":
        if output_dir is None:
            output_dir = _newest_resumable_run(RUNS_ROOT / recipe)
        found = checkpoint.newest_complete(output_dir) if output_dir is not None else None
        if found is not None:
            return output_dir, found, output_dir.name, run_id
        output_dir = output_dir or RUNS_ROOT / recipe / default_name
        # A fresh start under `auto` may land in a directory that only has incomplete checkpoints: that is fine.
        return output_dir, None, output_dir.name, run_id
    if resume is not None:
        found = checkpoint.resolve_checkpoint_path(Path(resume))
        if output_dir is None:
            output_dir = found.parent.parent
        return output_dir, found, output_dir.name, run_id
    output_dir = output_dir or RUNS_ROOT / recipe / default_name
    if checkpoint.checkpoints_root(output_dir).exists() or (output_dir / "metrics.csv").exists():
        raise UsageError(
            f"--output-dir {output_dir} already holds a run; continue it with --resume-from auto "
            "or choose another --output-dir (nothing there is overwritten)"
        )
    return output_dir, None, output_dir.name, run_id


def _newest_resumable_run(recipe_root: Path) -> Path | None:
    if not recipe_root.is_dir():
        return None
    runs = [p for p in recipe_root.iterdir() if p.is_dir() and checkpoint.newest_complete(p) is not None]
    return max(runs, key=lambda p: checkpoint.newest_complete(p).stat().st_mtime, default=None)


def _announce_rank(accelerator: Accelerator) -> None:
    # Every rank says what it sees: tests (and people) read the world size from inside the processes.
    backend = accelerator.state.backend or "none"
    print(
        f"[rank {accelerator.process_index}/{accelerator.num_processes}] host={socket.gethostname()} "
        f"node_rank={os.environ.get('GROUP_RANK', os.environ.get('NODE_RANK', '0'))} device={accelerator.device} "
        f"backend={backend} mixed_precision={accelerator.mixed_precision}",
        file=sys.stderr,
        flush=True,
    )


def _flat_config(run: Run) -> dict:
    values = {}
    for key, value in dataclasses.asdict(run.config).items():
        values[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    values["world_size"] = run.accelerator.num_processes
    return values


def _write_config_json(run: Run, extra_info: dict) -> None:
    accelerator = run.accelerator
    info = {
        "recipe": run.recipe,
        "run_name": run.run_name,
        "run_id": run.run_id,
        "config": json.loads(json.dumps(dataclasses.asdict(run.config), default=str)),
        "world_size": accelerator.num_processes,
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", "1")) or 1),
        "backend": accelerator.state.backend,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "device_name": torch.cuda.get_device_name() if accelerator.device.type == "cuda" else "cpu",
        "mixed_precision": accelerator.mixed_precision,
        "resumed_from": str(run.resume_checkpoint) if run.resume_checkpoint else None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "versions": _versions(),
        "git_commit": _git_commit(),
        **extra_info,
    }
    path = run.output_dir / "config.json"
    if path.exists():  # a resume: keep what the earlier life recorded
        previous = sorted(run.output_dir.glob("config.previous-*.json"))
        path.rename(run.output_dir / f"config.previous-{len(previous) + 1}.json")
    write_json(path, info)


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
        except UsageError as error:
            failure[0] = str(error)
    if state.num_processes > 1:
        broadcast_object_list(failure, from_process=0)
    if failure[0] is not None:
        raise UsageError(failure[0])
    return value if state.is_main_process else build()
