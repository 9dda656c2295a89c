"""A tiny regression recipe that uses every part of the toolkit API the model families need, for the tests.

    python tests/toy_recipe.py --output-dir /tmp/toy --max-steps 12 --eval-every-steps 3

What it exercises (each can be switched off to show the test notices):
- shared extra state in checkpoints: an EMA of the training loss that scales the loss (`--loss-ema`);
- per-rank state: a carry, the last predictions of each row position of this rank's batch, fed back as an input
  feature of the next batch (as HRM carries its recurrent state); under split batches rank r's rows are global rows
  r*b .. r*b+b-1, so N processes carry exactly what one process carries (`--carry`);
- rank-free per-sample coins (`keyed_uniform`): input features dropped per sample (`--feature-drop`);
- keyed dropout (`--dropout`), so N processes match one process with dropout on;
- early stopping with `loop.request_stop` from the evaluation (`--patience`), step cadence (`--eval-every-steps`);
- test hooks that make the loss or the validation metric NaN at a step (`--diverge-at-step`,
  `--nan-metric-at-step`) or explode (`--explode-at-step`);
- the split finish: best weights loaded, test metrics, then an artifact computed WITH gradients and a collective
  (the input Jacobian, summed over ranks) before the process group ends;
- DDP arguments through start_run (broadcast_buffers=False, printed by every rank).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from toolkit.process import begin_process  # noqa: E402, I001

begin_process()  # first, as the recipes: before torch (SIGUSR1, OpenMP's wait policy)

# isort: split
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from toolkit import (  # noqa: E402
    EarlyStopping,
    KeyedDropout,
    Run,
    TrainConfig,
    TrainingLoop,
    keyed_uniform,
    make_optimizer,
    one_line_errors,
    parse_config,
    start_run,
)

FEATURE_DROP = 7  # purpose key of the per-sample coins


@dataclass
class ToyConfig(TrainConfig):
    samples: int = 512
    features: int = 4
    hidden: int = 16
    dropout: float = 0.2
    feature_drop: float = 0.3
    loss_ema: bool = True
    carry: bool = True
    patience: int = 0
    """Stop when val_mse has not improved by --min-delta for this many evaluations (0 = never)."""
    min_delta: float = 0.0
    diverge_at_step: int = 0
    """Test hook: the training loss becomes NaN at this step (0 = never)."""
    explode_at_step: int = 0
    """Test hook: the training loss is multiplied by 1e7 at this step (0 = never)."""
    nan_metric_at_step: int = 0
    """Test hook: val_mse is NaN when evaluated at this step (0 = never)."""
    main_metric: str = "val_mse"
    """Test hook: the metric the loop selects the best step by."""
    signal_at_step: int = 0
    """Test hook: --signal-rank sends itself SIGUSR1 during this step (0 = never)."""
    signal_rank: int = 0
    plain_dropout: bool = False
    """Test hook: torch's nn.Dropout (rank-dependent masks) instead of KeyedDropout."""
    optimizer: str = "sgd"
    epochs: int = 3
    batch_size: int = 64
    lr: float = 0.05
    log_with: str = "csv"
    log_every: int = 1


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"id": torch.tensor(i), "x": self.x[i], "y": self.y[i]}


class LossEMA:
    """Shared state: an exponential average of the training loss (the same on every rank)."""

    def __init__(self):
        self.value = torch.tensor(1.0, dtype=torch.float64)

    def update(self, loss: torch.Tensor) -> None:
        self.value = 0.9 * self.value + 0.1 * loss.detach().double().cpu()

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class Carry:
    """Per-rank state: last predictions for each row position of this rank's micro-batch."""

    def __init__(self):
        self.last = None

    def state_dict(self):
        return {"last": self.last}

    def load_state_dict(self, state):
        self.last = state["last"]


@one_line_errors
def main(argv=None):
    cfg = parse_config(ToyConfig, argv)
    with start_run(cfg, recipe="toy", ddp_kwargs={"broadcast_buffers": False}) as run:
        return train(run, cfg)


def train(run: Run, cfg: ToyConfig) -> dict:
    accelerator = run.accelerator

    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(cfg.samples, cfg.features, generator=generator)
    y = torch.sin(x @ torch.linspace(-1, 1, cfg.features))[:, None] + 0.05 * torch.randn(cfg.samples, 1,
                                                                                         generator=generator)
    split = int(0.8 * cfg.samples)
    run.describe_data(f"toy-{cfg.samples}-{cfg.features}", samples=cfg.samples)
    train_loader = DataLoader(Rows(x[:split], y[:split]), batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    valid_loader = DataLoader(Rows(x[split:], y[split:]), batch_size=cfg.batch_size)

    dropout = nn.Dropout(cfg.dropout) if cfg.plain_dropout else KeyedDropout(cfg.dropout, batch_dim=0)
    model = nn.Sequential(nn.Linear(cfg.features + 1, cfg.hidden), nn.Tanh(), dropout, nn.Linear(cfg.hidden, 1))
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr)
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
    print(f"rank {accelerator.process_index}: ddp broadcast_buffers="
          f"{getattr(model, 'broadcast_buffers', None)}", file=sys.stderr, flush=True)

    ema, carry = LossEMA(), Carry()

    def inputs(batch):
        features = batch["x"]
        if cfg.feature_drop:
            coins = keyed_uniform(cfg.seed, FEATURE_DROP, loop.global_step, batch["id"])
            features = features * (coins >= cfg.feature_drop).to(features.dtype)[:, None].to(features.device)
        previous = carry.last if (cfg.carry and carry.last is not None) else torch.zeros(len(features), 1)
        return torch.cat([features, previous.to(features.device)], dim=1)

    def mean_squared_error():
        errors = []
        for batch in valid_loader:
            zeros = torch.zeros(len(batch["x"]), 1, device=batch["x"].device)
            prediction = model(torch.cat([batch["x"], zeros], dim=1))
            errors.append(accelerator.gather_for_metrics((prediction - batch["y"]).pow(2).sum(dim=1)))
        return torch.cat(errors).double().mean().item()

    early_stopping = EarlyStopping("val_mse", cfg.patience, cfg.min_delta)  # decided where the metric is known

    def validate():
        mse = mean_squared_error()
        if loop.global_step == cfg.nan_metric_at_step:
            mse = float("nan")
        early_stopping.after_evaluation(loop, {"val_mse": mse})
        return {"val_mse": mse}

    loop = TrainingLoop(run, model, train_loader, evaluate=validate, main_metric=cfg.main_metric,
                        higher_is_better=False, state=({"loss_ema": ema} if cfg.loss_ema else {})
                        | ({"early_stopping": early_stopping} if cfg.patience else {}),
                        rank_state={"carry": carry} if cfg.carry else {})
    loop.start()
    for _epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                prediction = model(inputs(batch))
                local = (prediction - batch["y"]).pow(2).mean()
                if loop.global_step + 1 == cfg.diverge_at_step:
                    local = local * float("nan")
                if loop.global_step + 1 == cfg.explode_at_step:
                    local = local * 1e7
                loss_value = accelerator.reduce(local.detach(), reduction="mean")
                scale = ema.value.float().item() if cfg.loss_ema else 1.0
                accelerator.backward(local / scale)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if cfg.loss_ema:
                ema.update(loss_value)
            carry.last = prediction.detach().cpu()
            loop.record_loss(loss_value)
            if loop.global_step + 1 == cfg.signal_at_step and accelerator.process_index == cfg.signal_rank:
                os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM signals one process of the job
        loop.end_epoch()

    loop.load_best()
    test = loop.test(lambda: {"test_mse": mean_squared_error()})
    # An artifact that needs gradients and the process group: the mean input Jacobian over all ranks' rows.
    rows = torch.cat([x[split:], torch.zeros(len(x) - split, 1)], dim=1).to(accelerator.device).requires_grad_()
    jacobian = torch.autograd.grad(accelerator.unwrap_model(model)(rows).sum(), rows)[0].mean(dim=0)
    jacobian = accelerator.reduce(jacobian, reduction="mean")
    if run.is_main:
        torch.save(jacobian.cpu(), run.output_dir / "jacobian.pt")
    return loop.finish(extra={"test": test})


if __name__ == "__main__":
    main()
