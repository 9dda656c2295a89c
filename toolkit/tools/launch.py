"""`python -m toolkit launch [accelerate launch arguments]`: `accelerate launch`, with launch failures as one line.

Takes exactly the arguments of `accelerate launch`. What it adds:
- a rendezvous timeout (`--rdzv_conf timeout=`, default 120 s, or $TOOLKIT_RDZV_TIMEOUT) so a machine that cannot
  reach the head node stops instead of waiting torchrun's 600 s;
- one `error:` line, no traceback and none of torchrun's log lines, for an unreachable head node, a port already in
  use, and for each worker that failed (rank, local rank, pid, host, exit status or signal). The workers' own
  errors are printed by the workers; when they failed on a usage error (exit status 2; the others stopped by the
  agent) rank 0 has already said what was wrong in one line, and the launcher adds nothing and exits 2;
- SIGTERM and SIGUSR1 forwarded to the workers, which checkpoint at their next step and exit 0
(toolkit.process.preemption),
  then one line and exit 0. The launcher sends the signal on to its children (torchrun's workers run in sessions of
  their own, so a signal to the launcher's process group does not reach them). For SIGTERM torchrun's agent does
  it itself once the workers run (its own handler: it waits up to 30 s for them before it kills them). A SIGUSR1
  that the launcher inherited as ignored (the SLURM scripts' `trap '' USR1`: there every process of the step gets
  it) stays ignored.
"""

from __future__ import annotations

import os
import signal
import socket
import sys


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from toolkit.errors import UsageError
    from toolkit.process import shutdown

    shutdown.not_a_worker()
    quiet_torchrun_logs()

    if os.environ.pop("_TOOLKIT_QUIET_LAUNCHER", None):
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)  # quiet launcher (see __main__), normal workers
    args = launch_command_parser().parse_args(argv)
    conf = [part for part in (args.rdzv_conf or "").split(",") if part]
    if not any(part.startswith("timeout=") for part in conf):
        conf.append(f"timeout={int(os.environ.get('TOOLKIT_RDZV_TIMEOUT', '120'))}")
    args.rdzv_conf = ",".join(conf)
    where = f"{args.main_process_ip or 'the head node'}:{args.main_process_port or 'its port'}"
    forwarded = forward_signals_to_workers()
    try:
        launch_command(args)
    except SignalException as stop:  # torchrun's agent: it has sent the workers this signal and waited for them
        name = signal.Signals(stop.sigval).name
        print(f"launcher: {name} forwarded to the workers; they checkpoint at their next step and stop (continue "
              "with --resume-from auto)", file=sys.stderr, flush=True)
        return 0
    except ConnectionError as error:  # Accelerate's own port check on the head node
        raise UsageError(f"{str(error).split('. ')[0]}; choose another --main_process_port") from None
    except DistError as error:  # the rendezvous store: unreachable head node, or timed out
        detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"could not join the run at {where} ({detail}); is machine 0 started, and are --main_process_ip, "
            "--main_process_port and --num_machines the same on every machine?"
        ) from None
    except ChildFailedError as error:
        failures = sorted(error.failures.items())
        # The workers the agent stopped (SIGTERM) after another failed are its doing, not theirs: the others are named
        causes = [(rank, f) for rank, f in failures if f.exitcode != -signal.SIGTERM] or failures
        if all(f.exitcode == 2 for _, f in causes):
            return 2  # a usage error: the recipe's rank 0 said what was wrong, in one line
        host = socket.gethostname()  # torch's ProcessFailure has no host: the failed workers ran on this machine
        for rank, failure in causes:
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
            print(f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) on {host} ended with "
                  f"{how}", file=sys.stderr, flush=True)
        return 1
    if forwarded:  # and every worker has ended well: checkpointed and stopped
        print(f"launcher: {signal.Signals(forwarded[-1]).name} forwarded to the workers; they checkpointed and "
              "stopped (continue with --resume-from auto)", file=sys.stderr, flush=True)
    return 0


def quiet_torchrun_logs() -> None:
    """torchrun's agent logs each stop and failure ("Sending process N closing signal SIGTERM", "failed (exitcode:
    2) local_rank: 0 ..."): two lines after a recipe's one-line usage error, and beside this launcher's own line for
    a failed worker or a forwarded signal, which say the same. Its loggers (torch.distributed.elastic.*) end at a
    handler that drops them, in the launcher's process only: the workers log as they would."""
    import logging

    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(logging.NullHandler())  # handled: logging's last-resort stderr handler stays out too
    elastic.propagate = False


def forward_signals_to_workers() -> list[int]:
    """SIGTERM and SIGUSR1 (unless inherited as ignored) go on to the launcher's children; torchrun's agent replaces
    the SIGTERM handler with its own when it starts the workers. Returns the list the handler appends each forwarded
    signal to."""
    import psutil

    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        children = psutil.Process().children()
        if not children:  # no worker started yet: the launcher stops, as it would have
            print(f"launcher: {signal.Signals(signum).name} before any worker started: stopping", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        forwarded.append(signum)
        for child in children:
            try:
                child.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    signal.signal(signal.SIGTERM, forward)
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN:
        signal.signal(signal.SIGUSR1, forward)
    return forwarded
