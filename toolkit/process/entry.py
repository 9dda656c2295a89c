"""The wrapper of a command's main(): every failure the toolkit knows is one line and an exit status.

    @one_line_errors
    def main(argv=None): ...

UsageError -> `error: ...`, exit 2; RunFailed -> `error: ...`, exit 1; losing another rank mid-run (it died, or hung
past --dist-timeout) -> one line naming it, exit 1; a run that checkpointed to restart under OpenMP's PASSIVE wait
policy (load arrived, toolkit.loop.restart) -> the same command again, resuming it, in this process. Whatever the
path,
what the run left running (heartbeat, launcher watch, process group) ends here, while the interpreter is whole
(toolkit.process.shutdown)."""

from __future__ import annotations

import functools
import os
import sys

from toolkit.console import say
from toolkit.errors import RunFailed, UsageError
from toolkit.loop import restart as restart_under_load
from toolkit.process import shutdown


def _is_the_script(main) -> bool:
    """Whether main() is the running script's own (`python recipe.py`, a launcher's worker): not one a test, a
    notebook or `python -c` calls, which a restart of the process (toolkit.loop.restart) would replace."""
    script, code = (sys.argv[0] if sys.argv else ""), getattr(main, "__code__", None)  # (a callable object: none)
    return (code is not None and getattr(main, "__module__", None) == "__main__" and os.path.isfile(script)
            and os.path.realpath(script) == os.path.realpath(code.co_filename))


def one_line_errors(main):
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        rank = os.environ.get("RANK", "0")
        prefix = "" if rank == "0" else f"[rank {rank}] "
        broken, restart = False, None
        try:
            with restart_under_load.allowed(_is_the_script(main)):  # the script's own main(): it may restart
                return main(*args, **kwargs)
        except restart_under_load.RestartUnderPassive as request:  # the run ended: restart once released
            restart = request
            raise
        except BrokenPipeError:  # `... | head`: the reader left; no traceback, and none at exit's flush either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
        except (UsageError, RunFailed) as error:
            # Rank 0 speaks for all (one line), the others exit quietly.
            if rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
                say(f"{prefix}error: {error}")
            raise SystemExit(2 if isinstance(error, UsageError) else 1) from None
        except BaseException as error:
            broken = shutdown.breaks_group(error)
            if not isinstance(error, Exception):
                raise
            from toolkit.run.distributed import lost_peers_message

            message = lost_peers_message(error)
            if message is None:
                raise
            say(f"{prefix}error: {message}")
            raise SystemExit(1) from None
        finally:
            shutdown.release(broken=broken)
            if restart is not None:
                restart_under_load.restart_process(restart)

    return wrapper
