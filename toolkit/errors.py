"""User errors: one line naming the flag, path or value and what would be valid, then exit 2."""

import functools
import os
import sys


class UsageError(Exception):
    """Bad input from the user: reported as one line naming the flag/path/value and what would be valid."""


def exit_on_usage_error(main):
    """Wrap a recipe's main(): a UsageError becomes `error: <message>` on stderr and exit status 2; losing another
    rank mid-run (it died, or hung past --dist-timeout) becomes one line naming it and exit status 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        rank = os.environ.get("RANK", "0")
        prefix = "" if rank == "0" else f"[rank {rank}] "
        from toolkit import shutdown

        broken = True
        try:
            result = main(*args, **kwargs)
            broken = False
            return result
        except UsageError as error:
            broken = False  # every rank checks the same input and stops: the group can be ended
            # Every rank checks the same input: rank 0 speaks for all (one line), the others exit quietly.
            if rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
                _say(f"{prefix}error: {error}")
            raise SystemExit(2) from None
        except SystemExit as exit_:
            broken = exit_.code not in (0, None, 2)  # pre-emption (0) and bad flags (2) end on every rank
            raise
        except Exception as error:
            from toolkit.distributed import lost_peers_message

            message = lost_peers_message(error)
            if message is None:
                raise
            _say(f"{prefix}error: {message}")
            raise SystemExit(1) from None
        finally:
            # Heartbeat, launcher watch and process group end here, while the interpreter is whole (toolkit.shutdown).
            shutdown.release(broken=broken)

    return wrapper


def write_line(line: str) -> None:
    """line and its newline to stderr in ONE write call, so lines of several ranks sharing a pipe never interleave
    mid-line (print() writes the text and the newline separately when PYTHONUNBUFFERED is set)."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured in-process)
        print(line, file=sys.stderr, flush=True)


def _say(line: str) -> None:
    # A live tqdm bar (on stderr, no newline at its end) is closed first so the line starts on a line of its own.
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except ImportError:
        pass
    write_line(line)
