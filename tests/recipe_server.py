"""Run a recipe script many times as `python SCRIPT ARGS...` without paying its imports each time (tests' bad inputs).

    python tests/recipe_server.py recipes/sasrec.py      # then one JSON request per line on stdin

The server imports what the script imports (it runs the script under another name, so its `main()` is not called),
then, for each request {"args", "cwd", "stdout", "stderr"}, forks a child that does what `python SCRIPT ARGS` does
from there on: cwd, argv, stdout and stderr on the given files, the script run as __main__, the atexit handlers,
the exit status (an uncaught exception prints its traceback and exits 1, as the interpreter does). The reply is
{"status": N} (-N: killed by signal N). Each bad-input case costs milliseconds instead of the seconds of importing
torch, datasets and accelerate again; the code under test is the same script, flags and checks.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback


def run_child(script: str, request: dict) -> None:
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [script, *request["args"]]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script]
    replies = os.fdopen(os.dup(1), "w")  # the replies' own channel: whatever the imports print goes elsewhere
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.close(quiet)
    runpy.run_path(script, run_name="recipe_server_preload")  # the imports; __main__ is not run
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(script, request)
        _, wait_status = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        replies.write(json.dumps({"status": status}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
