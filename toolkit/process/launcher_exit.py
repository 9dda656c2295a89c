"""One line instead of torch's traceback when `accelerate launch` or `torchrun` itself is stopped by a signal.

torchrun's agent (which `accelerate launch` runs for 2+ processes) turns SIGTERM into a `SignalException`: it sends
the signal on to the workers, waits up to 30 s for them (they checkpoint at their next step and say
`stopped by SIGTERM at step N`), then raises it again, and the launcher ends with a 20-line traceback from torch's
code. That code runs in the launcher's process, which nothing in a recipe can reach, so the project installs one
line, accelerate_recipes_launcher.pth, beside itself (setup.py): in a Python process started as `accelerate launch`
or `torchrun` (sys.orig_argv says so), and only there, it calls quiet_signal_exit(), which replaces the traceback of
that one exception with one line. The exit status stays 1 (the launcher was stopped); every other error is printed
as before. Nothing else is imported or changed, there or anywhere: no signal handler, no environment.
"""

from __future__ import annotations

import sys


def launcher_name(orig_argv: list[str]) -> str | None:
    """"accelerate launch" or "torchrun" when the command line (sys.orig_argv: the interpreter, then the script or
    -m and the module) starts one of them, `python -m accelerate.commands.launch` and `python -m torch.distributed.run`
    included; None for every other program."""
    words = [arg.replace("\\", "/").rsplit("/", 1)[-1] for arg in orig_argv[1:4]]
    if words[:1] == ["-m"]:
        words = words[1:]
    if words[:1] == ["accelerate"] and words[1:2] == ["launch"] or words[:1] == ["accelerate.commands.launch"]:
        return "accelerate launch"
    if words[:1] in (["torchrun"], ["torch.distributed.run"]):
        return "torchrun"
    return None


def _is_signal_exception(exc_type: type) -> bool:
    return exc_type.__name__ == "SignalException" and exc_type.__module__.startswith("torch.distributed.elastic")


def quiet_signal_exit(program: str) -> None:
    """Print torchrun's SignalException as one line (the launcher's name, the signal, what the workers do)."""
    previous = sys.excepthook
    if getattr(previous, "_one_line_for_signals", False):
        return  # site-packages can be read twice (lib and lib64): once is enough

    def excepthook(exc_type, exc, tb):
        if not _is_signal_exception(exc_type):
            return previous(exc_type, exc, tb)
        sigval = getattr(exc, "sigval", None)
        name = getattr(sigval, "name", None) or f"signal {sigval}"
        sys.stderr.write(f"{program}: stopped by {name}, sent on to the workers: they checkpoint at their next step "
                         "(continue with --resume-from auto)\n")
        sys.stderr.flush()

    excepthook._one_line_for_signals = True
    sys.excepthook = excepthook


def install_if_launcher() -> None:
    """The .pth line's call: quiet_signal_exit() in a launcher's process, nothing anywhere else."""
    if program := launcher_name(getattr(sys, "orig_argv", [])):
        quiet_signal_exit(program)
