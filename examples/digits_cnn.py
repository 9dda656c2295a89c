"""A fifth family on the template: a small CNN classifying generated 8 x 8 digit-like images.

    python examples/digits_cnn.py --max-steps 60
    python -m toolkit launch --config_file accelerate_configs/cpu_2proc.yaml examples/digits_cnn.py --resume-from auto

Ten classes, each a fixed random 8 x 8 stroke pattern; a sample is its class's pattern, shifted by a pixel at most,
plus noise. Written from recipes/template.py: only the data, the model and the metric are its own.
"""

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before torch: SIGUSR1 pre-emption and OpenMP's wait policy

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    KeyedDropout,
    Run,
    TrainConfig,
    TrainingLoop,
    global_mean,
    make_optimizer,
    model_line,
    one_line_errors,
    parse_config,
    require_at_least,
    require_batch_fits,
    require_range,
    shuffled_batches,
    start_run,
)


@dataclass
class DigitsConfig(TrainConfig):
    samples: int = 4000  # generated images; the last 20% are held out (half validation, half test)
    channels: int = 16
    dropout: float = 0.1
    noise: float = 0.5
    optimizer: str = "adamw"
    epochs: int = 5
    batch_size: int = 64
    log_with: str = "csv"


def check(cfg: DigitsConfig) -> None:
    require_at_least(cfg, 10, "samples")
    require_at_least(cfg, 1, "channels")
    require_range(cfg, "[0, 1)", "dropout")
    require_batch_fits(cfg.batch_size, int(0.8 * cfg.samples), "training images")


def generated_digits(cfg: DigitsConfig) -> tuple[TensorDataset, ...]:
    generator = torch.Generator().manual_seed(cfg.seed)  # the data is a function of the flags alone
    patterns = (torch.rand(10, 8, 8, generator=generator) > 0.6).float()
    labels = torch.randint(0, 10, (cfg.samples,), generator=generator)
    shifts = torch.randint(-1, 2, (cfg.samples, 2), generator=generator)
    images = torch.stack([patterns[y].roll(tuple(s.tolist()), (0, 1)) for y, s in zip(labels, shifts, strict=True)])
    images = (images + cfg.noise * torch.randn(images.shape, generator=generator)).unsqueeze(1)
    cuts = [0, int(0.8 * cfg.samples), int(0.9 * cfg.samples), cfg.samples]  # train, validation, test
    return tuple(TensorDataset(images[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(DigitsConfig, argv, description=__doc__, check=check)
    with start_run(cfg, recipe="digits_cnn") as run:
        return train(run, cfg)


def train(run: Run, cfg: DigitsConfig) -> dict:
    accelerator = run.accelerator
    train_set, valid_set, test_set = generated_digits(cfg)
    run.describe_data(f"digits-{cfg.samples}-noise{cfg.noise}-seed{cfg.seed}", samples=cfg.samples)
    order = shuffled_batches(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs)
    train_loader = DataLoader(train_set, batch_sampler=order)
    valid_loader, test_loader = (DataLoader(s, batch_size=cfg.batch_size) for s in (valid_set, test_set))

    model = nn.Sequential(nn.Conv2d(1, cfg.channels, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
                          KeyedDropout(cfg.dropout, batch_dim=0), nn.Flatten(), nn.Linear(cfg.channels * 16, 10))
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr)
    run.print(model_line(f"CNN {cfg.channels} channels", model))
    model, optimizer, train_loader, valid_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, valid_loader, test_loader)

    def accuracy(loader) -> float:
        right = [accelerator.gather_for_metrics((model(x).argmax(-1) == y).float()) for x, y in loader]
        return torch.cat(right).double().mean().item()

    loop = TrainingLoop(run, model, train_loader, evaluate=lambda: {"val_accuracy": accuracy(valid_loader)},
                        main_metric="val_accuracy", batches_per_epoch=order.batches_in_epoch)
    loop.start()
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    summed = F.cross_entropy(model(x).float(), y, reduction="sum")
                loss, loss_value = global_mean(accelerator, summed, y.numel())  # the GLOBAL batch's mean
                accelerator.backward(loss)
                loop.optimizer_step(optimizer, loss=loss_value)
        loop.end_epoch()
    return loop.finish_at_best(lambda: {"test_accuracy": accuracy(test_loader)})


if __name__ == "__main__":
    main()
