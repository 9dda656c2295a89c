"""The loop's parts that decide alone, tested alone: the evaluation and checkpoint cadence, the agreement over
ranks (one process here; two gloo processes agree in test_clean_exit and test_toolkit_api), the after-step hook."""

from __future__ import annotations

import pytest
from accelerate import Accelerator

from toolkit.agreement import Agreement, agree
from toolkit.cadence import epoch_end_save_due, evaluation_due, mid_epoch_save_due


def test_evaluation_every_n_steps_or_at_every_nth_epoch_end():
    assert [s for s in range(1, 13) if evaluation_due(4, 1, s, 0, 3)] == [4, 8, 12]  # steps win over epochs
    # --eval-every 2: the ends of epochs 2, 4 (epochs completed), never mid-epoch
    ends = [(epoch, batches) for epoch in range(1, 5) for batches in (0, 3) if evaluation_due(0, 2, 99, epoch, batches)]
    assert ends == [(2, 0), (4, 0)]
    assert evaluation_due(0, 1, 7, 1, 0) and not evaluation_due(0, 1, 7, 1, 1)


def test_checkpoints_mid_epoch_and_at_epoch_ends():
    assert [s for s in range(1, 10) if mid_epoch_save_due(3, s, new_best=False)] == [3, 6, 9]
    assert not any(mid_epoch_save_due(0, s, new_best=False) for s in range(1, 10))  # 0: none mid-epoch
    assert mid_epoch_save_due(0, 5, new_best=True)  # load_best() needs the best step's weights
    assert epoch_end_save_due(0, 7, new_best=False, last=False)  # 0: every epoch end
    assert not epoch_end_save_due(5, 7, new_best=False, last=False)
    assert epoch_end_save_due(5, 10, new_best=False, last=False)
    assert epoch_end_save_due(5, 7, new_best=True, last=False) and epoch_end_save_due(5, 7, new_best=False, last=True)


@pytest.mark.parametrize("flags", [{}, {"preempted": True}, {"diverged": True}, {"stop": True},
                                   {"preempted": True, "diverged": True, "stop": True}])
def test_one_process_agrees_with_itself_by_name(flags):
    agreed = agree(Accelerator(cpu=True), **flags)
    assert agreed == Agreement(**flags)
    assert (agreed.preempted, agreed.diverged, agreed.stop) == tuple(flags.get(k, False)
                                                                     for k in ("preempted", "diverged", "stop"))
