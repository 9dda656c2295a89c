"""SASRec / TiSASRec, with or without mHC, on MovieLens: next-item recommendation.

Runs unchanged on one CPU, several CPU processes (gloo), 1-8 GPUs and several nodes:

    python recipes/sasrec.py                                   # MovieLens-100K on this machine
    python recipes/sasrec.py --preset ml-1m --data-path ml-1m/ratings.dat      # the paper's ML-1M settings
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/sasrec.py --resume-from auto
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/sasrec.py --variant tisasrec-mhc

Features: four variants (--variant sasrec | tisasrec | sasrec-mhc | tisasrec-mhc) with Post-LN, Pre-LN or the
original layer-norm placement (--norm); BCE with one sampled negative per position (the paper) or full softmax
cross-entropy (--loss ce); training negatives drawn from outside the user's TRAINING items (as the original code:
held-out items can be negatives), keyed by (seed, epoch, user, position), and dropout keyed by sample, so any
process count draws the same ones; leave-one-out evaluation by timestamp, sampled (100 untouched negatives, ties
count against the target) and full ranking (all items, the user's history excluded), HR@10 and NDCG@10; the best
validation checkpoint is kept and the test metrics are reported for it.

Errors (one line, exit 2, before anything is written): unknown --variant/--norm/--loss, a --data-path that does not
exist or is not MovieLens (bad lines named), out-of-range numbers, --batch-size not divisible by the process count
or larger than the data, --eval-negatives larger than what users left untouched, fp16 on CPU, --resume-from a path
that is not a complete intact checkpoint, resuming with changed settings or data, an --output-dir that already
holds a run (without --resume-from), is a file, is not writable, or is in use by a live run.

Presets (--preset; any flag overrides the preset's value): `ml-100k` (the default: MovieLens-100K, maxlen 50, 200
epochs, fetched by itself) and `ml-1m` (the paper's and the reference PyTorch port's ML-1M settings, seed 004's batch
and learning rate: maxlen 200, d 50, 2 blocks, 1 head, dropout 0.2, batch 128, Adam 1e-3 (0.9, 0.98), 1,000 epochs
evaluated every 20; needs --data-path to MovieLens-1M's ratings.dat).
"""

from __future__ import annotations

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before anything heavy: SIGUSR1 (pre-emption) only sets a flag from here on; OpenMP's policy

# isort: split
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from toolkit import (
    Run,
    TrainConfig,
    TrainingLoop,
    UntouchedItems,
    UsageError,
    device_batches,
    global_mean,
    hit_rate_and_ndcg,
    main_process_first,
    make_optimizer,
    model_line,
    one_line_errors,
    parse_config,
    pin_memory,
    rank_of_target,
    require_at_least,
    require_batch_fits,
    require_finite,
    require_path,
    require_range,
    sample_negatives,
    shuffled_batches,
    start_run,
)
from toolkit.data.movielens import VALID_INPUT, UserSequences, leave_one_out, most_touched, prepare_movielens
from toolkit.models.sasrec import SASRec

TRAIN_NEGATIVES, EVAL_NEGATIVES = 1, 2  # purposes of the keyed negative sampler


@dataclass
class SASRecConfig(TrainConfig):
    """SASRec / TiSASRec on MovieLens; the defaults are the `ml-100k` preset's (PRESETS below)."""

    variant: Literal["sasrec", "tisasrec", "sasrec-mhc", "tisasrec-mhc"] = "sasrec"
    """Model: SASRec, time-interval-aware TiSASRec, and either with mHC (manifold-constrained hyper-connections)."""
    norm: Literal["post", "pre", "original"] = "post"
    """Layer-norm placement: Post-LN, Pre-LN, or the original code's (only the attention query normalised)."""
    loss: Literal["bce", "ce"] = "bce"
    """bce: one sampled negative per position (paper); ce: softmax cross-entropy over all items."""
    dataset: Literal["ml-100k", "ml-1m"] = "ml-100k"
    """MovieLens size. ml-100k is fetched by itself (GroupLens, else the recbole wheel); ml-1m needs --data-path."""
    data_path: Path | None = None
    """A MovieLens u.data, ratings.dat or RecBole .inter file (or a directory holding one)."""
    cache_dir: Path = Path("~/.cache/accelerate-recipes")
    """Where raw downloads and the prepared `datasets` cache live."""
    hidden: int = 50
    """Hidden size d."""
    blocks: int = 2
    """Self-attention blocks."""
    heads: int = 1
    """Attention heads (hidden must divide by it)."""
    maxlen: int = 50
    """Longest history fed to the model (the most recent items). 50 suits ML-100K (median history 65) and
    keeps a CPU run short; the paper used 200 on ML-1M."""
    dropout: float = 0.2
    """Dropout rate (0 for exact multi-process equivalence tests)."""
    time_span: int = 256
    """TiSASRec: largest relative time interval distinguished."""
    mhc_streams: int = 4
    """mHC: residual streams n."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam with betas (0.9, 0.98) as in the paper, or plain SGD."""
    weight_decay: float = 0.0
    """L2 weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, then constant."""
    eval_negatives: int = 100
    """Sampled evaluation: negatives per user, never touched by the user."""
    # Recipe defaults for the shared flags (MovieLens-100K: 943 users, so an epoch is a handful of steps).
    epochs: int = 200
    batch_size: int = 128
    lr: float = 1e-3
    eval_every: int = 10

    captures_whole_step = True  # its step runs through loop.run_step (--cuda-graphs: one CUDA graph)


# --preset NAME (toolkit.run.presets): the first is the default; any flag given overrides the preset's value.
PRESETS = {
    "ml-100k": ("MovieLens-100K (fetched by itself), maxlen 50, 200 epochs: minutes on a CPU", SASRecConfig()),
    # pmixer/SASRec.pytorch's ml-1m run (main.py's defaults): batch 128, lr 0.001 (seed 004's single-GPU values),
    # maxlen 200, d 50, 2 blocks, 1 head, dropout 0.2, 1000 epochs evaluated every 20.
    "ml-1m": (
        "the paper's ML-1M settings (needs --data-path .../ml-1m/ratings.dat): maxlen 200, batch 128, lr 1e-3, "
        "1000 epochs",
        SASRecConfig(dataset="ml-1m", maxlen=200, epochs=1000, eval_every=20, batch_size=128, lr=1e-3, hidden=50,
                     blocks=2, heads=1, dropout=0.2),
    ),
}


def check(cfg: SASRecConfig) -> None:
    """Recipe-specific checks, before anything is built."""
    require_path(cfg.data_path, "--data-path", VALID_INPUT)
    require_at_least(cfg, 1, "hidden", "blocks", "heads", "maxlen", "time_span", "mhc_streams", "eval_negatives")
    if cfg.hidden % cfg.heads:
        raise UsageError(f"--hidden {cfg.hidden} is not divisible by --heads {cfg.heads}")
    require_range(cfg, "[0, 1)", "dropout")
    require_finite(cfg, "weight_decay")
    if cfg.warmup_steps < 0:
        raise UsageError(f"--warmup-steps {cfg.warmup_steps} is invalid; it must be >= 0 (0 = no warm-up)")


SCORE_EVERY_POSITION_ON = ("cuda",)  # next_item_loss: the device types whose CE scores the padding too (no index)


def next_item_loss(
    scorer: SASRec, hidden: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor | None, accelerator
):
    """The objective trained on: per target (0 = padding, left out) BCE vs its negative, or CE over all items (None)."""
    positions = targets > 0
    # Every position scored and the padding's terms zeroed, not the targets picked by a boolean index: that reads its
    # size on the host (a sync on a GPU, which a captured step cannot hold). BCE's two dot products a position cost
    # the same either way on a CPU; CE's product with every item does not (at maxlen 200, mostly padding: 953 against
    # 530 ms a step), so on a CPU CE scores the targets' positions alone
    if negatives is not None:
        logits = scorer.score_items(hidden, torch.stack([targets, negatives], dim=-1))  # [B, L, 2]
        labels = torch.zeros_like(logits)
        labels[..., 0] = 1.0
        per_item = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none").sum(dim=-1)
        per_item = per_item.masked_fill(~positions, 0.0)
    elif hidden.device.type in SCORE_EVERY_POSITION_ON:  # the padding's targets (0) ignored: their terms are 0
        logits = scorer.score_all(hidden).float()
        logits[..., 0] = float("-inf")  # padding is never a prediction
        per_item = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=0)
    else:
        logits = scorer.score_all(hidden[positions]).float()
        logits[:, 0] = float("-inf")  # padding is never a prediction
        per_item = F.cross_entropy(logits, targets[positions], reduction="none")
    return global_mean(accelerator, per_item.sum(), positions.sum())  # mean over the GLOBAL batch's targets


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PRESETS, argv, description=__doc__, check=check)
    with start_run(cfg, recipe="sasrec") as run:
        return train(run, cfg)


def train(run: Run, cfg: SASRecConfig) -> dict:
    accelerator = run.accelerator

    # ---- data: prepared and cached by the main process, loaded from the cache by the others ----------------
    def check_eval_negatives(num_items: int, most_touched: int) -> None:
        if cfg.eval_negatives > num_items - most_touched:
            raise UsageError(
                f"--eval-negatives {cfg.eval_negatives} is more than the {num_items - most_touched} items that "
                f"every user left untouched ({num_items} items; the most active user touched {most_touched}); "
                f"give at most {num_items - most_touched}"
            )

    prepared = main_process_first(run, lambda: prepare_movielens(
        cfg.dataset, cfg.data_path, cfg.cache_dir.expanduser(),
        check=lambda ds, meta: check_eval_negatives(meta["num_items"], most_touched(ds))))  # before it is cached
    sequences, meta = prepared
    split = leave_one_out(sequences, meta, cfg.maxlen)
    check_eval_negatives(meta["num_items"], int(split.touched.sum(dim=1).max()))  # a build found in the cache
    prepared.describe(run, users=meta["num_users"], items=meta["num_items"])
    touched = split.touched.to(accelerator.device)  # evaluation: candidates the user never touched at all
    train_negatives = UntouchedItems(split.train_touched.to(accelerator.device))  # outside the training items
    eval_negatives = sample_negatives(
        split.touched, split.eval_users, torch.arange(cfg.eval_negatives),
        seed=cfg.seed, purpose=EVAL_NEGATIVES, epoch=0,
    )
    trainable_users = torch.nonzero((split.train_target > 0).any(dim=1)).flatten()
    train_set = UserSequences(
        {"input": split.train_input, "time": split.train_time, "target": split.train_target}, users=trainable_users
    )
    valid_set = UserSequences(
        {"input": split.valid_input, "time": split.valid_time, "target": split.valid_target,
         "future": split.test_target},  # the test item is still unseen when validating: rank it like any other
        users=split.eval_users,
    )
    test_set = UserSequences(
        {"input": split.test_input, "time": split.test_time, "target": split.test_target,
         "future": torch.zeros_like(split.test_target)},
        users=split.eval_users,
    )
    negatives_table = torch.zeros(split.num_users, cfg.eval_negatives, dtype=torch.long)
    negatives_table[split.eval_users] = eval_negatives
    negatives_table = negatives_table.to(accelerator.device)
    loader_args = dict(
        batch_size=cfg.batch_size, num_workers=cfg.num_workers, pin_memory=pin_memory(accelerator.device)
    )
    require_batch_fits(cfg.batch_size, len(train_set), "training users")
    # Full global batches only (N processes and one process take identical steps), each epoch a keyed permutation;
    # on the device, cut there per rank (toolkit.run.device_data); a set too large for it goes through a DataLoader.
    batches = shuffled_batches(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs)
    train_loader = device_batches(run, train_set, batches, num_workers=cfg.num_workers,
                                  pin_memory=pin_memory(accelerator.device))
    valid_loader = DataLoader(valid_set, shuffle=False, **loader_args)
    test_loader = DataLoader(test_set, shuffle=False, **loader_args)
    run.print(f"data: {meta['num_users']} users, {meta['num_items']} items, {meta['num_interactions']} interactions "
              f"({meta['source']})")

    # ---- model and optimisation ----------------------------------------------------------------------------
    time_aware = cfg.variant.startswith("tisasrec")
    model = SASRec(
        meta["num_items"], hidden=cfg.hidden, blocks=cfg.blocks, heads=cfg.heads, maxlen=cfg.maxlen,
        dropout=cfg.dropout, norm=cfg.norm, time_aware=time_aware, time_span=cfg.time_span,
        mhc=cfg.variant.endswith("-mhc"), mhc_streams=cfg.mhc_streams,
    )
    # --kernels auto: the CPU fast paths swapped in, proven on two users' training sequences at the run's maxlen,
    # in training mode (dropout on), through the hidden states and the scores of two items a position
    two = default_collate([train_set[index] for index in range(min(2, len(train_set)))])
    two = {key: value.to(accelerator.device) for key, value in two.items()}

    def example(m):
        hidden = m(two["input"], two["time"] if time_aware else None)
        return hidden, m.score_items(hidden, torch.stack([two["target"], two["input"]], dim=-1))

    model = run.with_kernels(model, example)
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                               weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (cfg.warmup_steps + 1)))
    model, optimizer, scheduler, valid_loader, test_loader = accelerator.prepare(
        model, optimizer, scheduler, valid_loader, test_loader
    )
    scorer = accelerator.unwrap_model(model)  # score_items / score_all share the (wrapped) model's weights
    run.print(model_line(f"{cfg.variant} ({cfg.norm}-LN)", scorer))

    loop = TrainingLoop(run, model, train_loader, evaluate=lambda: ranking_metrics(valid_loader, "val"),
                        main_metric="val_sampled_ndcg@10")

    def training_loss(batch):
        inputs, targets = batch["input"], batch["target"]
        hidden = model(inputs, batch["time"] if time_aware else None)
        negatives = None
        if cfg.loss == "bce":
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            negatives = train_negatives.sample(batch["user"], positions, seed=cfg.seed, purpose=TRAIN_NEGATIVES,
                                               epoch=loop.device_epoch)  # a tensor: a captured step replays it
        return next_item_loss(scorer, hidden, targets, negatives, accelerator)

    def ranking_metrics(loader, prefix):
        sampled_ranks, full_ranks = [], []
        for batch in loader:
            users, targets = batch["user"], batch["target"]
            with accelerator.autocast():
                hidden = model(batch["input"], batch["time"] if time_aware else None)[:, -1]
            negatives = negatives_table[users]
            sampled = scorer.score_items(hidden, torch.cat([targets[:, None], negatives], dim=1)).float()
            full = scorer.score_all(hidden).float()
            rows = torch.arange(len(users), device=full.device)
            allowed = ~touched[users]  # the user's history is excluded from full ranking ...
            allowed[rows, batch["future"]] = True  # ... but not items still in the future at this point
            allowed[rows, targets] = False  # the target is not its own competitor
            allowed[:, 0] = False  # padding
            ranks = torch.stack([rank_of_target(sampled[:, 0], sampled[:, 1:]),
                                 rank_of_target(full[rows, targets], full, allowed)], dim=1)
            ranks = accelerator.gather_for_metrics(ranks)  # drops the samples padded onto the last batch
            sampled_ranks.append(ranks[:, 0])
            full_ranks.append(ranks[:, 1])
        metrics = {}
        for kind, ranks in (("sampled", sampled_ranks), ("full", full_ranks)):
            hr, ndcg = hit_rate_and_ndcg(torch.cat(ranks), k=10)
            metrics[f"{prefix}_{kind}_hr@10"], metrics[f"{prefix}_{kind}_ndcg@10"] = hr, ndcg
        metrics[f"{prefix}_users"] = int(sum(len(r) for r in sampled_ranks))
        return metrics

    # ---- train: the loop takes the run directory and resumes; it evaluates and checkpoints when due ----------
    def train_step(batch):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss, loss_value = training_loss(batch)
            accelerator.backward(loss)
            loop.optimizer_step(optimizer, scheduler, loss=loss_value)

    loop.start()
    for _epoch in loop.epochs():
        for batch in loop.batches():
            loop.run_step(train_step, batch)  # --cuda-graphs: captured once, replayed
        loop.end_epoch()

    # ---- test the best validation checkpoint ---------------------------------------------------------------
    return loop.finish_at_best(lambda: ranking_metrics(test_loader, "test"))


if __name__ == "__main__":
    main()
