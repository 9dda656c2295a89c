"""`python -m toolkit launch [accelerate launch arguments]`: `accelerate launch`, with launch failures as one line.

Takes exactly the arguments of `accelerate launch`. What it adds:
- a rendezvous timeout (`--rdzv_conf timeout=`, default 120 s, or $TOOLKIT_RDZV_TIMEOUT) so a machine that cannot
  reach the head node stops instead of waiting torchrun's 600 s;
- one `error:` line, no traceback, for an unreachable head node, a port already in use, and for each worker that
  failed (rank, host, exit status or signal). The workers' own errors are printed by the workers.
"""

from __future__ import annotations

import os


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from toolkit.errors import UsageError

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
        for rank, failure in sorted(error.failures.items()):
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
            print(f"error: rank {rank} (local rank {failure.local_rank}) on {failure.hostname} ended with {how}",
                  flush=True)
        return 1
    return 0
