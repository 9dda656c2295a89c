"""When the loop evaluates and saves: pure functions of the flags and the position, unit-tested alone.

Evaluation: every --eval-every-steps optimizer steps, else at the end of every --eval-every-th epoch (and always at
the run's end, which the loop decides). Checkpoints: mid-epoch every --checkpoint-every steps and at a new best
(load_best() needs its weights); at an epoch end also every epoch when --checkpoint-every is 0, and at the last one.
"""

from __future__ import annotations


def evaluation_due(eval_every_steps: int, eval_every: int, global_step: int, epoch: int, batches_done: int) -> bool:
    """Does the cadence ask for an evaluation here (--eval-every-steps, or an --eval-every epoch end)?
    epoch: epochs completed; batches_done: micro-batches consumed in the current one (0 at an epoch's end)."""
    if eval_every_steps:
        return global_step % eval_every_steps == 0
    return batches_done == 0 and epoch % eval_every == 0


def mid_epoch_save_due(checkpoint_every: int, global_step: int, new_best: bool) -> bool:
    """A checkpoint inside an epoch: at a new best, or every --checkpoint-every steps (0: none mid-epoch)."""
    return new_best or bool(checkpoint_every and global_step % checkpoint_every == 0)


def epoch_end_save_due(checkpoint_every: int, global_step: int, new_best: bool, last: bool) -> bool:
    """A checkpoint at an epoch's end: the last epoch, a new best, every epoch when --checkpoint-every is 0, else
    when the step is a multiple of it."""
    return last or new_best or checkpoint_every == 0 or global_step % checkpoint_every == 0
