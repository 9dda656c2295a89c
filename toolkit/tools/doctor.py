"""`python -m toolkit doctor`: does this launch form a working process group? Checked with values, not just no-error.

Runs under any launcher, with the same code as the recipes (accelerate's PartialState, cpu mode without a GPU,
so gloo on CPU and nccl on GPU):

    python -m toolkit doctor                                                              # 1 process
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml -m toolkit doctor   # 2 CPU processes, gloo
    torchrun --nproc-per-node 2 -m toolkit doctor
    srun python -m toolkit doctor      # SLURM_PROCID/SLURM_NTASKS/... mapped to RANK/WORLD_SIZE/...; the sbatch
                                       # script exports MASTER_ADDR (head node) and MASTER_PORT

The main process prints the backend, world size and every rank's global/local/node rank, host, device and torch
threads, then one PASS/FAIL line per check:

    world_size        the group's size equals the launcher's WORLD_SIZE (and --expect-world-size); ranks are 0..n-1
    all_reduce_int    sum of (rank+1) over ranks == n(n+1)/2 (int64)
    all_reduce_float  a float32 tensor of (rank+1) * k/8 sums exactly (every partial sum is representable)
    broadcast         rank 0's random float32 tensor (plus -0.0, inf, nan, a subnormal) arrives bit-identical
    all_gather        the gathered ranks equal [0, 1, ..., n-1]
    barrier           completes within --timeout
    bandwidth_<S>MB   all-reduce of S MiB of float32: every result element == n; median time over --iters after
                      --warmup iterations (the slowest rank's median), bus bandwidth 2(n-1)/n * bytes / time in GB/s

Every rank's failures are summed with an all-reduce, so all ranks agree on the outcome: exit 0 when every check
passed on every rank, else 1 with the failing checks named. A collective that raises (a lost rank, a timeout)
leaves the group unusable: that rank reports the check and exits 1 at once. `--json PATH` writes everything the
main process printed as JSON.

Self-test hook: TOOLKIT_DOCTOR_INJECT_FAULT=<check>[,<check>...] makes the LAST rank corrupt its own result of
that value check (all_reduce_int, all_reduce_float, broadcast, all_gather, bandwidth) after the collective ran, so
the tests can see that a wrong value is caught, named, and agreed on by every rank. Never set it otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.console import write_line
from toolkit.errors import UsageError
from toolkit.process import shutdown
from toolkit.run.devices import runs_on_cpu

FAULT_ENV = "TOOLKIT_DOCTOR_INJECT_FAULT"
INJECTABLE = ("all_reduce_int", "all_reduce_float", "broadcast", "all_gather", "bandwidth")
MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="seconds any collective (and forming the group) may wait for a rank (default 60)",
    )
    parser.add_argument("--skip-bandwidth", action="store_true", help="skip the all-reduce bandwidth measurement")
    parser.add_argument(
        "--sizes-mb",
        type=float,
        nargs="+",
        default=[1.0, 64.0],
        metavar="MB",
        help="all-reduce sizes in MiB of float32 to time (default: 1 64)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size (default 3)")
    parser.add_argument(
        "--iters", type=int, default=10, help="timed all-reduces per size; the median counts (default 10)"
    )
    parser.add_argument(
        "--expect-world-size",
        type=int,
        default=None,
        metavar="N",
        help="fail unless exactly N processes joined (e.g. $((SLURM_NNODES * 4)))",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write the report as JSON (main process only)"
    )


# ---- launcher environment -------------------------------------------------------------------------------------


def slurm_env_mapping(env: dict[str, str]) -> dict[str, str]:
    """The torch.distributed variables to set for a process started directly by srun (one task per rank).

    Empty when a launcher already set RANK/WORLD_SIZE (torchrun, accelerate launch, also under srun) or when this
    is not a multi-task SLURM step. MASTER_ADDR must come from the sbatch script; MASTER_PORT defaults to 29500.
    """
    if "RANK" in env or "WORLD_SIZE" in env or "SLURM_PROCID" not in env:
        return {}
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not world or int(world) <= 1:
        return {}
    node = int(env.get("SLURM_NODEID", "0"))
    if not env.get("MASTER_ADDR"):
        raise UsageError(
            f"SLURM task {env['SLURM_PROCID']} of {world}: MASTER_ADDR is not set; export it in the sbatch script "
            "(MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)) together with MASTER_PORT"
        )
    tasks_here = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), node)
    if tasks_here is None:
        tasks_here = int(env.get("SLURM_NTASKS_PER_NODE", "1"))
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(int(world)),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(tasks_here),
        "NODE_RANK": str(node),
        "MASTER_ADDR": env["MASTER_ADDR"],
        "MASTER_PORT": env.get("MASTER_PORT") or "29500",
    }


def _tasks_on_node(spec: str | None, node: int) -> int | None:
    """SLURM's compressed tasks-per-node list ('2(x3),1') at index `node`."""
    if not spec:
        return None
    counts: list[int] = []
    try:
        for part in spec.split(","):
            if "(x" in part:
                count, repeat = part.rstrip(")").split("(x")
                counts.extend([int(count)] * int(repeat))
            else:
                counts.append(int(part))
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def _node_rank() -> int:
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _launcher(mapped_from_slurm: bool) -> str:
    if mapped_from_slurm:
        return "srun (SLURM_* mapped to RANK/WORLD_SIZE)"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun / accelerate launch"
    if "WORLD_SIZE" in os.environ:
        return "WORLD_SIZE from the environment"
    return "single process"


# ---- the group, with identity collectives for a single process ------------------------------------------------


class _Group:
    def __init__(self, state):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = state.process_index
        self.size = state.num_processes
        self.device = state.device
        self.backend = dist.get_backend() if self.distributed else None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(tensor, src=src)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not self.distributed:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor)
        return out

    def barrier(self) -> None:
        if not self.distributed:
            return
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str
    seconds: float
    raised: bool = False


class _Doctor:
    def __init__(self, group: _Group, args, env_world_size: int, faults: set[str]):
        self.group = group
        self.args = args
        self.env_world_size = env_world_size
        self.faults = faults
        self.results: list[CheckResult] = []
        self.bandwidth: list[dict] = []
        self.broken = False  # a collective raised: the group cannot be trusted for anything further

    def injected(self, name: str) -> bool:
        return name in self.faults and self.group.rank == self.group.size - 1

    def run(self, name: str, check: Callable[[], tuple[bool, str]]) -> None:
        if self.broken:
            return
        started = time.perf_counter()
        try:
            passed, detail = check()
            raised = False
        except Exception as error:  # a timeout, a lost peer, a bad device: name it and stop using the group
            passed, detail, raised = False, f"raised {type(error).__name__}: {str(error).splitlines()[0][:300]}", True
            self.broken = True
            write_line(f"[rank {self.group.rank}] doctor: FAIL {name}: {detail}")
        self.results.append(CheckResult(name, passed, detail, round(time.perf_counter() - started, 6), raised))

    # ---- the checks ----------------------------------------------------------------------------------------
    def world_size(self, infos: list[dict]) -> tuple[bool, str]:
        n = self.group.size
        ranks = sorted(info["rank"] for info in infos)
        problems = []
        if ranks != list(range(n)):
            problems.append(f"ranks seen {ranks}, expected 0..{n - 1}")
        if self.env_world_size != n:
            problems.append(f"the launcher asked for WORLD_SIZE={self.env_world_size} but {n} process(es) joined")
        expected = self.args.expect_world_size
        if expected is not None and expected != n:
            problems.append(f"--expect-world-size {expected} but {n} process(es) joined")
        if problems:
            return False, "; ".join(problems)
        return True, f"{n} process(es), ranks {ranks}"

    def all_reduce_int(self) -> tuple[bool, str]:
        g, n = self.group, self.group.size
        value = g.all_reduce(torch.tensor([g.rank + 1], dtype=torch.int64, device=g.device))
        if self.injected("all_reduce_int"):
            value += 1
        got, expected = int(value.item()), n * (n + 1) // 2
        return got == expected, f"sum of rank+1 = {got}, expected n(n+1)/2 = {expected}"

    def all_reduce_float(self) -> tuple[bool, str]:
        g, n = self.group, self.group.size
        base = (torch.arange(4096, dtype=torch.float32) % 7 + 1) / 8  # k/8: every partial sum is exact in float32
        tensor = g.all_reduce((base * (g.rank + 1)).to(g.device))
        if self.injected("all_reduce_float"):
            tensor[0] = torch.nextafter(tensor[0], torch.tensor(math.inf, device=g.device))
        expected = base * (n * (n + 1) // 2)
        wrong = int((tensor.cpu() != expected).sum())
        return wrong == 0, f"4096 float32 sums of (rank+1)*k/8, {wrong} differ from n(n+1)/2*k/8"

    def broadcast(self) -> tuple[bool, str]:
        g = self.group
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        original = torch.randn(4096, generator=generator)
        original[:4] = torch.tensor([-0.0, math.inf, math.nan, 1e-45])  # sign of zero, inf, nan, a subnormal
        tensor = original.clone().to(g.device) if g.rank == 0 else torch.empty(4096, device=g.device)
        g.broadcast(tensor, src=0)
        if self.injected("broadcast"):
            tensor[100] = torch.nextafter(tensor[100], torch.tensor(math.inf, device=g.device))
        # Compare bits (int32 views): every rank's copy against rank 0's original (rank 0 holds it itself).
        copies = [c.cpu().view(torch.int32) for c in g.all_gather(tensor.view(torch.int32))]
        reference = original.view(torch.int32) if g.rank == 0 else copies[0]
        differing = [r for r, c in enumerate(copies) if not torch.equal(c, reference)]
        if g.rank == 0 and not torch.equal(copies[0], original.view(torch.int32)):
            differing = sorted(set(differing) | {0})
        if differing:
            return False, f"rank 0's random tensor arrived changed on rank(s) {differing}"
        return (
            True,
            f"4096 random float32 (with -0.0, inf, nan, subnormal) from rank 0 bit-identical on {g.size} rank(s)",
        )

    def all_gather(self) -> tuple[bool, str]:
        g = self.group
        gathered = [int(t.item()) for t in g.all_gather(torch.tensor([g.rank], dtype=torch.int64, device=g.device))]
        if self.injected("all_gather"):
            gathered = gathered[::-1] if len(gathered) > 1 else [gathered[0] + 1]
        expected = list(range(g.size))
        return gathered == expected, f"gathered {_clip(gathered)}, expected {_clip(expected)}"

    def barrier(self) -> tuple[bool, str]:
        started = time.perf_counter()
        self.group.barrier()
        elapsed = time.perf_counter() - started
        ok = elapsed < self.args.timeout
        return ok, f"{elapsed * 1e3:.2f} ms (timeout {self.args.timeout:g} s)"

    def bandwidth_for(self, size_mb: float) -> tuple[bool, str]:
        g, n, args = self.group, self.group.size, self.args
        numel = max(1, int(size_mb * MIB) // 4)
        nbytes = numel * 4
        tensor = torch.empty(numel, dtype=torch.float32, device=g.device)
        times, wrong = [], 0
        for i in range(args.warmup + args.iters):
            tensor.fill_(1.0)
            g.sync()
            g.barrier()  # start together: the time is the collective's, not a late rank's
            started = time.perf_counter()
            g.all_reduce(tensor)
            g.sync()
            elapsed = time.perf_counter() - started
            if i >= args.warmup:
                times.append(elapsed)
            if self.injected("bandwidth") and i == 0:
                tensor[0] += 1
            wrong += int((tensor != n).sum())
        median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=g.device)
        median = float(g.all_reduce(median, op=dist.ReduceOp.MAX if g.distributed else None).item())
        algbw = nbytes / median / 1e9
        busbw = 2 * (n - 1) / n * algbw
        self.bandwidth.append(
            {
                "size_mb": size_mb,
                "bytes": nbytes,
                "warmup": args.warmup,
                "iterations": args.iters,
                "median_time_sec": median,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
            }
        )
        detail = (
            f"bus {busbw:.3f} GB/s, alg {algbw:.3f} GB/s, median {median * 1e3:.3f} ms "
            f"over {args.iters} (after {args.warmup} warm-up)"
        )
        if wrong:
            return False, f"{wrong} result element(s) differ from n={n}; {detail}"
        return median > 0, detail

    # ---- agreement --------------------------------------------------------------------------------------------
    def agreed_failures(self) -> list[int]:
        """Per check, how many ranks failed it (summed over ranks with an all-reduce)."""
        flags = torch.tensor([0 if r.passed else 1 for r in self.results], dtype=torch.int64, device=self.group.device)
        return [int(v) for v in self.group.all_reduce(flags).cpu()]


def _clip(values: list) -> str:
    return str(values) if len(values) <= 16 else f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)})"


def _rank_info(state) -> dict:
    device = state.device
    return {
        "rank": state.process_index,
        "local_rank": state.local_process_index,
        "node_rank": _node_rank(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
    }


def _faults() -> set[str]:
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return set()
    names = {name.strip() for name in spec.split(",") if name.strip()}
    unknown = names - set(INJECTABLE)
    if unknown:
        raise UsageError(f"{FAULT_ENV}={spec}: unknown check(s) {sorted(unknown)}; injectable: {', '.join(INJECTABLE)}")
    return names


def main(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    if args.warmup < 0 or args.iters < 1:
        raise UsageError(f"--warmup {args.warmup} --iters {args.iters}: need --warmup >= 0 and --iters >= 1")
    if any(size <= 0 for size in args.sizes_mb):
        raise UsageError(f"--sizes-mb {' '.join(f'{s:g}' for s in args.sizes_mb)}: sizes must be positive")
    faults = _faults()
    mapping = slurm_env_mapping(dict(os.environ))
    os.environ.update(mapping)
    env_world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)

    from accelerate import PartialState
    from accelerate.utils import gather_object

    started = time.perf_counter()
    try:
        state = PartialState(cpu=runs_on_cpu(), timeout=timedelta(seconds=args.timeout))
    except Exception as error:
        rank = os.environ.get("RANK", "0")
        write_line(
            f"[rank {rank}] doctor: FAIL process_group: could not form the group of WORLD_SIZE={env_world_size} within "
            f"{args.timeout:g} s (MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT="
            f"{os.environ.get('MASTER_PORT')}): {type(error).__name__}: {str(error).splitlines()[0][:300]}; are all "
            f"{env_world_size} processes started (srun runs one per task; the batch script alone is one) and is "
            "MASTER_ADDR:MASTER_PORT reachable from every node?"
        )
        return 1
    init_seconds = time.perf_counter() - started
    group = _Group(state)
    doctor = _Doctor(group, args, env_world_size, faults)
    infos: list[dict] = []
    try:
        infos = sorted(gather_object([_rank_info(state)]), key=lambda info: info["rank"])
    except Exception as error:
        doctor.broken = True
        doctor.results.append(
            CheckResult("gather_rank_info", False, f"raised {type(error).__name__}: {error}", 0.0, True)
        )

    doctor.run("world_size", lambda: doctor.world_size(infos))
    doctor.run("all_reduce_int", doctor.all_reduce_int)
    doctor.run("all_reduce_float", doctor.all_reduce_float)
    doctor.run("broadcast", doctor.broadcast)
    doctor.run("all_gather", doctor.all_gather)
    doctor.run("barrier", doctor.barrier)
    bandwidth_note = None
    if args.skip_bandwidth:
        bandwidth_note = "skipped (--skip-bandwidth)"
    elif group.size == 1:
        bandwidth_note = "skipped (1 process: nothing crosses a link)"
    else:
        for size in args.sizes_mb:
            doctor.run(f"bandwidth_{size:g}MB", lambda size=size: doctor.bandwidth_for(size))

    report = {
        "backend": group.backend,
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "world_size": group.size,
        "launcher": _launcher(bool(mapping)),
        "timeout_sec": args.timeout,
        "init_seconds": round(init_seconds, 3),
        "ranks": infos,
        "versions": {"torch": torch.__version__, "accelerate": _version("accelerate")},
    }
    if doctor.broken:
        # The group cannot agree any more: this rank reports what it saw and fails.
        failed = [r.name for r in doctor.results if not r.passed]
        report |= {
            "ok": False,
            "agreed": False,
            "failed": failed,
            "checks": [asdict(r) for r in doctor.results],
            "bandwidth": doctor.bandwidth,
            "bandwidth_note": bandwidth_note,
        }
        if state.is_main_process:
            _print_report(report)
            _write_json(args.json, report)
        write_line(f"[rank {group.rank}] doctor: FAILED: {', '.join(failed)}")
        return 1

    failing_ranks = doctor.agreed_failures()
    details = gather_object([{r.name: r.detail for r in doctor.results if not r.passed}])
    checks = []
    for result, count in zip(doctor.results, failing_ranks, strict=True):
        entry = asdict(result) | {"passed": count == 0, "failed_ranks": []}
        if count:
            entry["failed_ranks"] = [rank for rank, seen in enumerate(details) if result.name in seen]
            if result.passed:  # passed here, failed elsewhere: show a failing rank's reason
                entry["detail"] = next(seen[result.name] for seen in details if result.name in seen)
        checks.append(entry)
    failed = [c["name"] for c in checks if not c["passed"]]
    report |= {
        "ok": not failed,
        "agreed": True,
        "failed": failed,
        "checks": checks,
        "bandwidth": doctor.bandwidth,
        "bandwidth_note": bandwidth_note,
    }
    if state.is_main_process:
        _print_report(report)
        _write_json(args.json, report)
    if group.distributed:
        # Leave together: an elastic launcher kills the other ranks as soon as one exits non-zero, which would cut
        # the main process off before its report is out.
        group.barrier()
        shutdown.release()
    return 0 if not failed else 1


def _print_report(report: dict) -> None:
    lines = [
        f"toolkit doctor: backend {report['backend'] or 'none'}, world size {report['world_size']}, "
        f"{report['distributed_type']}, launcher: {report['launcher']}, timeout {report['timeout_sec']:g} s, "
        f"group formed in {report['init_seconds']:.2f} s",
        f"{'rank':>4} {'local':>5} {'node':>4}  {'host':<24} {'device':<8} {'threads':>7} {'pid':>8}",
    ]
    for info in report["ranks"]:
        lines.append(
            f"{info['rank']:>4} {info['local_rank']:>5} {info['node_rank']:>4}  {info['hostname']:<24} "
            f"{info['device']:<8} {info['torch_threads']:>7} {info['pid']:>8}"
        )
    for check in report["checks"]:
        where = f" (seen on rank(s) {check['failed_ranks']})" if check.get("failed_ranks") else ""
        lines.append(f"{'PASS' if check['passed'] else 'FAIL'}  {check['name']:<18} {check['detail']}{where}")
    if report.get("bandwidth_note"):
        lines.append(f"      bandwidth          {report['bandwidth_note']}")
    if report["ok"]:
        lines.append(f"doctor: all {len(report['checks'])} checks passed")
    else:
        lines.append(f"doctor: FAILED: {', '.join(report['failed'])}")
    print("\n".join(lines), flush=True)


def _write_json(path: Path | None, report: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
