"""Template: the smallest complete recipe; copy it to start a new family (README, "Writing a recipe").

    python recipes/template.py --max-steps 40     # --preset wide: the second preset
    python -m toolkit launch --config_file accelerate_configs/cpu_2proc.yaml recipes/template.py --resume-from auto

A two-layer MLP learns y = sin(x . w) on generated data. All the toolkit promises holds for it as written: bit-exact
resume, N processes with global batch B equal to one process with B (KeyedDropout, not nn.Dropout), one-line errors,
checkpoints, metrics.csv, summary.json and `python -m toolkit verify`.
"""

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before torch: SIGUSR1 pre-emption and OpenMP's wait policy

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    KeyedDropout,
    Run,
    TrainConfig,
    TrainingLoop,
    global_mean,
    make_optimizer,
    one_line_errors,
    parse_config,
    require_at_least,
    require_batch_fits,
    require_range,
    shuffled_batches,
    start_run,
)


@dataclass
class TemplateConfig(TrainConfig):
    samples: int = 2048  # generated (x, y) pairs; the last 20% are held out (half validation, half test)
    features: int = 8
    hidden: int = 32
    dropout: float = 0.1
    epochs: int = 5
    batch_size: int = 64
    log_with: str = "csv"


# --preset NAME (`python -m toolkit ls`): the first is the default; flags override. Published settings go here too.
PRESETS = {"small": ("2,048 generated samples, hidden 32, 5 epochs: seconds on a CPU", TemplateConfig()),
           "wide": ("20,480 samples, hidden 256, 20 epochs", TemplateConfig(samples=20480, hidden=256, epochs=20))}


def check(cfg: TemplateConfig) -> None:
    """The recipe's own checks: one line naming the flag, before anything is made (sweeps run them too)."""
    require_at_least(cfg, 1, "samples", "features", "hidden")
    require_range(cfg, "[0, 1)", "dropout")
    require_batch_fits(cfg.batch_size, int(0.8 * cfg.samples), "training samples")


def generated_data(cfg: TemplateConfig) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(cfg.seed)  # the data is a function of the flags alone
    x = torch.randn(cfg.samples, cfg.features, generator=generator)
    y = torch.sin(x @ torch.randn(cfg.features, 1, generator=generator))
    cuts = [0, int(0.8 * cfg.samples), int(0.9 * cfg.samples), cfg.samples]  # train, validation, test
    return tuple(TensorDataset(x[a:b], y[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PRESETS, argv, description=__doc__, check=check)
    with start_run(cfg, recipe="template") as run:  # ends the process group on every path
        return train(run, cfg)


def train(run: Run, cfg: TemplateConfig) -> dict:
    accelerator = run.accelerator

    train_set, valid_set, test_set = generated_data(cfg)  # then the data, the model, the loop
    run.describe_data(f"sin-{cfg.samples}x{cfg.features}-seed{cfg.seed}", samples=cfg.samples)
    order = shuffled_batches(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs)  # keyed, global
    train_loader = DataLoader(train_set, batch_sampler=order)
    valid_loader, test_loader = (DataLoader(s, batch_size=cfg.batch_size) for s in (valid_set, test_set))

    model = nn.Sequential(nn.Linear(cfg.features, cfg.hidden), nn.GELU(), KeyedDropout(cfg.dropout, batch_dim=0),
                          nn.Linear(cfg.hidden, 1))
    optimizer = make_optimizer("adamw", model.parameters(), lr=cfg.lr)
    model, optimizer, train_loader, valid_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, valid_loader, test_loader)

    def mse(loader) -> float:  # gather_for_metrics: every rank gets the same value, padding dropped
        errors = [accelerator.gather_for_metrics((model(x) - y).pow(2).sum(dim=1)) for x, y in loader]
        return torch.cat(errors).double().mean().item()

    loop = TrainingLoop(run, model, train_loader, evaluate=lambda: {"val_mse": mse(valid_loader)},
                        main_metric="val_mse", higher_is_better=False, batches_per_epoch=order.batches_in_epoch)
    loop.start()
    for _epoch in loop.epochs():  # the model is in train mode here (evaluations put it back)
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    squared = (model(x).float() - y).pow(2).sum()
                loss, loss_value = global_mean(accelerator, squared, y.numel())  # the GLOBAL batch's mean
                accelerator.backward(loss)
                loop.optimizer_step(optimizer, loss=loss_value)
        loop.end_epoch()
    return loop.finish_at_best(lambda: {"test_mse": mse(test_loader)})


if __name__ == "__main__":
    main()
