"""The toolkit's public surface: what a recipe imports, `from toolkit import start_run, TrainingLoop, ...`.

Each name is loaded from its module on first use (PEP 562), so `import toolkit` loads nothing else and changes
nothing in the process (no signal handler, no environment variable: tests/test_imports.py). The modules behind it:
process/ (the process: begin_process, the one-line-errors entry), run/ (a run's life: flags, start, devices,
randomness, batches, optimizers, what it keeps), loop/ (the training loop and its parts), tools/ (`python -m
toolkit ...`), kernels/ (fast paths, proven at every start), and the families' models/, data/ and export/.
"""

from __future__ import annotations

import importlib

PUBLIC = {
    "RunFailed": "toolkit.errors",
    "UsageError": "toolkit.errors",
    "begin_process": "toolkit.process",
    "one_line_errors": "toolkit.process.entry",
    "TrainConfig": "toolkit.run.config",
    "parse_config": "toolkit.run.config",
    "require_at_least": "toolkit.run.config",
    "require_finite": "toolkit.run.config",
    "require_range": "toolkit.run.config",
    "Run": "toolkit.run.start",
    "main_process_first": "toolkit.run.start",
    "start_run": "toolkit.run.start",
    "TrainingLoop": "toolkit.loop.training",
    "make_optimizer": "toolkit.run.optim",
    "model_line": "toolkit.run.optim",
    "register_optimizer": "toolkit.run.optim",
    "global_mean": "toolkit.run.distributed",
    "mean_over_processes": "toolkit.run.distributed",
    "KeyedDropout": "toolkit.run.randomness",
    "UntouchedItems": "toolkit.run.randomness",
    "keyed_hash": "toolkit.run.randomness",
    "keyed_uniform": "toolkit.run.randomness",
    "sample_negatives": "toolkit.run.randomness",
    "CrossEpochBatchSampler": "toolkit.run.sampler",
    "shuffled_batches": "toolkit.run.sampler",
    "device_batches": "toolkit.run.device_data",
    "pin_memory": "toolkit.run.devices",
    "runs_on_cpu": "toolkit.run.devices",
    "error_metrics": "toolkit.run.metrics",
    "hit_rate_and_ndcg": "toolkit.run.metrics",
    "masked_error_sums": "toolkit.run.metrics",
    "rank_of_target": "toolkit.run.metrics",
    "format_table": "toolkit.run.tracking",
    "EarlyStopping": "toolkit.run.early_stopping",
    "require_batch_fits": "toolkit.data.prepared",
    "require_path": "toolkit.data.prepared",
    "replaces": "toolkit.kernels",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
