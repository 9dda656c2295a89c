"""How a process of a run ends: every thread it started and the process group ended while the interpreter is whole.

A worker that leaves anything running into interpreter finalization can die at exit with `terminate called
without an active exception` (SIGABRT) after a successful run: the launcher then exits non-zero and SLURM marks the
job FAILED. What was left running, and what ends it here:

- gloo's threads (`gloo_tcp_loop`, `pt_gloo_runloop`): they live as long as the ProcessGroupGloo object. When one
  of them drops the last reference to a finished collective's tensors while the interpreter is being torn down, it
  needs the GIL, which it can no longer get, and the process aborts. `destroy_process_group()` alone did not end
  them: importing `torch._dynamo` (DDP does it in its constructor) while a process group exists keeps 9 references
  to it for the life of the process, so the group outlived every DDP model and every destroy. `before_process_group`
  imports it first (`toolkit.run.start.start_run` calls it), after which destroying the group and freeing the model
  really ends its threads. And the DDP models' Reducers are freed before the group is destroyed (release_reducers
  says why: otherwise freeing the model joins gloo's threads holding the GIL, and a thread that needs it hangs).
- the heartbeat thread (toolkit.run.distributed.PeerWatch) and its store client: stopped and joined.
- the launcher watch (toolkit.process.orphans): stopped and joined.
- DataLoader workers: they end with their iterators, which are gone once the recipe's main() has returned.

`TrainingLoop.finish()` leaves together (a barrier: rank 0 still writing summary.json must not see its peer's
sockets close under it), stops the heartbeat and destroys the group; `release()` runs when the recipe's main()
returns or raises (toolkit.process.entry.one_line_errors) and, for whatever path skipped that, again at exit
(begin_process() or start_run() registers it): a script that makes its own Accelerator() ends its group without a
line of its own.
`TOOLKIT_EXIT_REPORT=1` makes every process print, as its last act, the threads still alive then: one line,
`[rank r] threads at exit: N (names)`.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

from toolkit.console import write_line
from toolkit.errors import RunFailed, UsageError

EXIT_REPORT = "TOOLKIT_EXIT_REPORT"
_launcher = False
_registered = False  # release_at_exit() was called: the exit hook is registered
_broken = False  # a peer was lost or an unexpected error ended main(): the group is not destroyed (it could hang)


def before_process_group() -> None:
    """Call before the process group is formed (see the module's docstring: torch._dynamo must not see it)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # one process forms no group (and makes no DDP model)
        import torch._dynamo  # noqa: F401  imported for its side effect, before the process group exists


def end_process_group(accelerator, together: bool = True) -> None:
    """The normal end of a run on every rank: all ranks meet (together=True; a collective), the heartbeat stops,
    the trackers end and the process group is destroyed."""
    from toolkit.run.distributed import stop_watching_peers

    if together and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    stop_watching_peers()
    release_reducers()
    accelerator.end_training()  # trackers' finish, then destroy_process_group


def breaks_group(error: BaseException) -> bool:
    """Whether an exception that ends main() may have left the process group unusable: not a usage error or a run
    failure (every rank checks the same input and agrees on a stop), nor a pre-emption (0) or bad flags (2) exit,
    which end on every rank; anything else (a lost peer, a bug) may have ended on this rank alone."""
    if isinstance(error, UsageError | RunFailed):
        return False
    if isinstance(error, SystemExit):
        return error.code not in (0, None, 2)
    return True


def release(broken: bool = False) -> None:
    """End whatever is still running, without waiting for other ranks: safe on any path (a usage error, a
    pre-emption exit, a normal return). broken: main() ended by a lost peer or an unexpected error; the process group
    is then left alone (destroying a group whose peer is gone can block, with NCCL) and the process exits non-zero
    anyway. Idempotent."""
    global _broken
    from toolkit.process import orphans

    _broken = _broken or broken
    # Only what this process imported can be running: a command that never imported torch (a data tool, a usage
    # error) must not pay for importing it here, at exit.
    peers = sys.modules.get("toolkit.run.distributed")
    if peers is not None:
        peers.stop_watching_peers()
    dist = sys.modules.get("torch.distributed")
    if not _broken and dist is not None and dist.is_available() and dist.is_initialized():
        release_reducers()
        dist.destroy_process_group()
    gc.collect()  # models in reference cycles hold the group's backend: free them while the interpreter is whole
    orphans.stop_watching()


def release_reducers() -> None:
    """Free the C++ Reducer (and its Logger) of every DDP model before the process group is destroyed.

    The group's Python object releases the GIL before its C++ destructor joins gloo's threads (torch wraps it for
    that); a Reducer does not. A Reducer that outlives destroy_process_group() is the group's last owner, so the join
    runs when the DDP model is freed (when main() returns), holding the GIL, while a gloo thread that is finishing
    the last collective waits for the GIL to free that collective's tensors: the process hangs for ever (seen, about
    1 run in 40: `~ProcessGroupGloo -> thread::join` against `AsyncAllgatherWork::~AsyncAllgatherWork ->
    gil_scoped_acquire`). The models are over by then; only their forward, which needs the Reducer, is gone."""
    parallel = sys.modules.get("torch.nn.parallel.distributed")
    dist = sys.modules.get("torch.distributed")
    if parallel is None or dist is None or not dist.is_initialized():
        return  # no DDP model was ever made, or no group to outlive
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance() of a dead weak proxy (torch.compile leaves some) raises
        if issubclass(type(obj), parallel.DistributedDataParallel):
            for name in ("logger", "reducer"):  # the Logger holds the Reducer
                obj.__dict__.pop(name, None)
    gc.collect()


def release_at_exit() -> None:
    """Register release() (and the exit report) to run at interpreter exit, once; begin_process() and start_run()
    call it, so that a script that forms its own group through Accelerator() needs no destroy_process_group()."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def live_threads() -> list[str]:
    """Names of this process's OS threads other than the calling one (Linux /proc; [] elsewhere); a Python thread is
    named by its Python name."""
    names = []
    me = str(threading.get_native_id())
    python_names = {str(t.native_id): t.name for t in threading.enumerate()}
    try:
        tasks = sorted(os.listdir("/proc/self/task"))
    except OSError:
        return names
    for task in tasks:
        if task == me:
            continue
        if task in python_names:
            names.append(python_names[task])
            continue
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue  # ended meanwhile
    return names


def not_a_worker() -> None:
    """This process launches workers (toolkit.tools.launch): no exit report of its own, which would read as a rank's."""
    global _launcher
    _launcher = True


def _at_exit() -> None:
    release()
    if os.environ.get(EXIT_REPORT) and not _launcher:
        threads = live_threads()
        rank = os.environ.get("RANK", "0")
        write_line(f"[rank {rank}] threads at exit: {len(threads)} ({', '.join(threads) or 'none'})")
