"""The two kinds of failure a run reports in one line (toolkit.process.entry turns them into exit statuses).

- UsageError, exit 2: bad input from the user, found before (or instead of) the work: the line names the flag,
  path or value and what would be valid.
- RunFailed, exit 1: the run started and cannot go on (a non-finite loss, a full disk, data that ran out): the line
  says what happened and what is kept.

A leaf module: it imports nothing from the toolkit, so every module may raise these."""


class UsageError(Exception):
    """Bad input from the user: reported as one line naming the flag/path/value and what would be valid; exit 2."""


class RunFailed(Exception):
    """A runtime failure: one line saying what happened and what was kept; exit 1."""


class TrainingStopped(RunFailed):
    """The run cannot go on (a non-finite loss or metric, a loader short of its epoch): one line naming the step;
    the checkpoints stay."""


ONE_LINE = (UsageError, RunFailed)  # what a command reports in one line


def same_failure(failure: Exception | str) -> Exception:
    """The failure to raise on every rank from what one rank found (an exception, or a usage problem's text): the
    same class, so every rank exits with the same status."""
    return failure if isinstance(failure, Exception) else UsageError(failure)
