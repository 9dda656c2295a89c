"""`python -m toolkit launch [accelerate launch arguments]`: `accelerate launch`, with launch failures as one line.

Takes exactly the arguments of `accelerate launch`. What it adds:
- a rendezvous timeout (`--rdzv_conf timeout=`, default 120 s, or $TOOLKIT_RDZV_TIMEOUT) so a machine that cannot
  reach the head node stops instead of waiting torchrun's 600 s;
- one `error:` line, no traceback, for an unreachable head node, a port already in use, and for each worker that
  failed (rank, local rank, pid, host, exit status or signal). The workers' own errors are printed by the workers;
  when they failed on a usage error (exit status 2; the others stopped by the agent) rank 0 has already said what
  was wrong in one line, and the launcher adds nothing and exits 2.
"""

from __future__ import annotations

import os
import signal
import socket
import sys


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from toolkit import shutdown
    from toolkit.errors import UsageError

    shutdown.not_a_worker()

    if os.environ.pop("_TOOLKIT_QUIET_LAUNCHER", None):
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)  # quiet launcher (see __main__), normal workers
    args = launch_command_parser().parse_args(argv)
    conf = [part for part in (args.rdzv_conf or "").split(",") if part]
    if not any(part.startswith("timeout=") for part in conf):
        conf.append(f"timeout={int(os.environ.get('TOOLKIT_RDZV_TIMEOUT', '120'))}")
    args.rdzv_conf = ",".join(conf)
    where = f"{args.main_process_ip or 'the head node'}:{args.main_process_port or 'its port'}"
    try:
        launch_command(args)
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
        usage = [f for _, f in failures if f.exitcode == 2]
        terminated = [f for _, f in failures if f.exitcode == -signal.SIGTERM]  # stopped by the agent after it
        if usage and len(usage) + len(terminated) == len(failures):
            return 2  # a usage error: the recipe's rank 0 said what was wrong, in one line
        host = socket.gethostname()  # torch's ProcessFailure has no host: the failed workers ran on this machine
        for rank, failure in failures:
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
            print(f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) on {host} ended with "
                  f"{how}", file=sys.stderr, flush=True)
        return 1
    return 0
