"""What the toolkit's loop costs: the same SASRec model and batches trained by a plain PyTorch loop and by the
recipe's loop (Accelerator, TrainingLoop, global-mean loss, per-step reseeding, progress bookkeeping), side by
side in one process. Rounds alternate between the two so machine noise hits both alike.

    python benchmarks/overhead.py [--steps 20] [--rounds 5]

Prints the median seconds per step of each and their ratio (goal: toolkit / plain <= 1.03).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.config import TrainConfig  # noqa: E402
from toolkit.data.movielens import UserSequences, leave_one_out, prepare_movielens  # noqa: E402
from toolkit.distributed import global_mean  # noqa: E402
from toolkit.loop import TrainingLoop  # noqa: E402
from toolkit.models.sasrec import SASRec  # noqa: E402
from toolkit.randomness import sample_negatives  # noqa: E402
from toolkit.run import start_run  # noqa: E402


def bce_sum(model, scorer, batch, touched, epoch):
    """The recipe's BCE loss (sum over non-padding positions and its count)."""
    inputs, targets = batch["input"], batch["target"]
    hidden = model(inputs)
    positions = targets > 0
    negatives = sample_negatives(touched, batch["user"], torch.arange(inputs.shape[1]), seed=0, purpose=1, epoch=epoch)
    logits = scorer.score_items(hidden[positions], torch.stack([targets[positions], negatives[positions]], dim=1))
    labels = torch.zeros_like(logits)
    labels[:, 0] = 1.0
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"), positions.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per round and loop")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/accelerate-recipes").expanduser())
    args = parser.parse_args()

    sequences, meta = prepare_movielens("ml-100k", None, args.cache_dir)
    split = leave_one_out(sequences, meta, 200)
    data = UserSequences({"input": split.train_input, "target": split.train_target})
    make_model = lambda: SASRec(meta["num_items"], hidden=50, blocks=2, maxlen=200, dropout=0.2)  # noqa: E731

    # ---- plain PyTorch ---------------------------------------------------------------------------------------
    torch.manual_seed(0)
    plain_model = make_model()
    plain_optimizer = torch.optim.Adam(plain_model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    plain_loader = DataLoader(data, batch_size=128, shuffle=True, drop_last=True)

    def plain_round(steps: int) -> float:
        done, start = 0, time.perf_counter()
        while done < steps:
            for batch in plain_loader:
                loss_sum, count = bce_sum(plain_model, plain_model, batch, split.touched, 0)
                loss = loss_sum / count
                loss.backward()
                plain_optimizer.step()
                plain_optimizer.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    break
        return (time.perf_counter() - start) / steps

    # ---- the recipe's loop -------------------------------------------------------------------------------------
    workdir = Path(tempfile.mkdtemp(prefix="overhead-"))
    config = TrainConfig(output_dir=workdir / "run", log_with="none", epochs=10_000, batch_size=128)
    run = start_run(config, recipe="overhead")
    accelerator = run.accelerator
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    loader = DataLoader(data, batch_size=128, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scorer = accelerator.unwrap_model(model)
    loop = TrainingLoop(run, model, loader, evaluate=dict, main_metric="none")
    batches = None

    def toolkit_round(steps: int) -> float:
        nonlocal batches
        start = time.perf_counter()
        for _ in range(steps):
            try:
                batch = next(batches)
            except (StopIteration, TypeError):
                loop.progress.epoch += 1
                loop.progress.batches_done = 0
                batches = loop.batches()
                batch = next(batches)
            with accelerator.accumulate(model):
                loss_sum, count = bce_sum(model, scorer, batch, split.touched, loop.progress.epoch)
                loss, value = global_mean(accelerator, loss_sum, count)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loop.record_loss(value)
        return (time.perf_counter() - start) / steps

    plain_round(3), toolkit_round(3)  # warm-up
    plain_times, toolkit_times = [], []
    for index in range(args.rounds):
        plain_times.append(plain_round(args.steps))
        toolkit_times.append(toolkit_round(args.steps))
        print(f"round {index + 1}: plain {plain_times[-1] * 1e3:.1f} ms/step, "
              f"toolkit {toolkit_times[-1] * 1e3:.1f} ms/step")
    plain, toolkit = statistics.median(plain_times), statistics.median(toolkit_times)
    print(f"median plain   {plain * 1e3:.1f} ms/step")
    print(f"median toolkit {toolkit * 1e3:.1f} ms/step")
    print(f"ratio toolkit/plain = {toolkit / plain:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
