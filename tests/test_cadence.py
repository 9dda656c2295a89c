"""The loop's parts that decide alone, tested alone: the evaluation and checkpoint cadence, the agreement over
ranks (one process here; two gloo processes agree in test_clean_exit and test_toolkit_api), the after-step hook."""

from __future__ import annotations

import pytest
from accelerate import Accelerator

from toolkit.loop.agreement import Agreement, agree
from toolkit.loop.cadence import epoch_end_save_due, evaluation_due, mid_epoch_save_due


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


AGREE = """
import json, sys
from toolkit.process import begin_process
begin_process()
from accelerate import Accelerator
from toolkit.loop.agreement import agree
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
seen = {"world": accelerator.num_processes,
        "stop_on_rank_1": agree(accelerator, stop=rank == 1).__dict__,
        "diverged_on_rank_0": agree(accelerator, diverged=rank == 0).__dict__,
        "preempted_on_both": agree(accelerator, preempted=True).__dict__,
        "terminated_on_rank_1": agree(accelerator, preempted=rank == 1, terminated=rank == 1).__dict__,
        "nothing": agree(accelerator).__dict__}
json.dump(seen, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


@pytest.mark.slow
def test_two_ranks_agree_on_what_either_one_saw(tmp_path):
    import json

    from tests.conftest import run_recipe

    (tmp_path / "agree.py").write_text(AGREE)
    run_recipe([str(tmp_path)], config="cpu_2proc.yaml", recipe=str(tmp_path / "agree.py"), timeout=300)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1]
    assert seen[0]["world"] == 2
    flags = {"preempted": False, "diverged": False, "stop": False, "terminated": False}
    assert seen[0]["stop_on_rank_1"] == {**flags, "stop": True}
    assert seen[0]["diverged_on_rank_0"] == {**flags, "diverged": True}
    assert seen[0]["preempted_on_both"] == {**flags, "preempted": True}
    assert seen[0]["terminated_on_rank_1"] == {**flags, "preempted": True, "terminated": True}  # SIGTERM on one rank
    assert seen[0]["nothing"] == flags


def test_the_keeper_prunes_to_keep_checkpoints_and_spares_the_best(tmp_path):
    from types import SimpleNamespace

    import torch

    from toolkit.loop.keeper import CheckpointKeeper
    from toolkit.loop.training import Progress
    from toolkit.run import checkpoint

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    run = SimpleNamespace(accelerator=accelerator, output_dir=tmp_path, is_main=True, resume_checkpoint=None,
                          config=SimpleNamespace(keep_checkpoints=1))
    keeper = CheckpointKeeper(run, model, {}, {})
    progress = Progress(run_id="x")
    for step, best in ((1, 1), (2, 2), (3, 2), (4, 2)):  # the best stays step 2 from step 2 on
        progress.global_step, progress.best_step = step, best
        keeper.save(progress)
        assert keeper.saved(step)
    kept = [checkpoint.step_of(p) for p in checkpoint.complete_checkpoints(tmp_path)]
    assert kept == [2, 4]  # the newest (keep 1) and the best
    assert checkpoint.read_progress(keeper.step_dir(4))["best_step"] == 2
