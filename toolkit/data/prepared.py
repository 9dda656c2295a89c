"""One shape for a family's prepared data, and the checks every reader makes the same way.

    prepared = prepare_movielens(...)               # a Prepared: (dataset, meta), with meta["fingerprint"]
    dataset, meta = prepared                        # unpacks as the pair it always was
    prepared.describe(run, users=meta["num_users"]) # config.json's "data"; a resume on other data is refused
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from toolkit.errors import UsageError


class Prepared(NamedTuple):
    """A family's data ready to train on: the dataset (a `datasets.Dataset`, or the family's own tensors) and its
    meta (JSON-serialisable; "fingerprint" names the content it was made from and how it was made)."""

    dataset: Any
    meta: dict

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def describe(self, run, **info) -> None:
        """Record the data in config.json (toolkit.run.start.Run.describe_data): on resume, other data is refused."""
        run.describe_data(self.fingerprint, source=self.meta.get("source"), **info)


def require_path(path: Path | None, flag: str, valid: str, kind: str = "any") -> None:
    """A path flag must name something that exists (kind "file", "dir" or "any"): otherwise one line naming the flag,
    the path, and what would be valid. None (the flag left out) passes."""
    if path is None:
        return
    found = Path(path).expanduser()
    if not found.exists():
        raise UsageError(f"{flag} {path} does not exist; {valid}")
    if kind == "file" and not found.is_file():
        raise UsageError(f"{flag} {path} is a directory; {valid}")
    if kind == "dir" and not found.is_dir():
        raise UsageError(f"{flag} {path} is a file; {valid}")


def require_batch_fits(batch_size: int, available: int, what: str, advice: str = "use a smaller one") -> None:
    """The global batch must fit in the training data (`what`: "training windows", ...), or an epoch has no step."""
    if batch_size > available:
        raise UsageError(f"--batch-size {batch_size} exceeds the {available} {what}; {advice}")


def counted_over_ranks(accelerator, counts: torch.Tensor) -> list[int]:
    """Per-column counts summed over the processes (each rank counted its own share of the data): what every rank
    must agree on before one of them refuses the data, so that all of them refuse it together."""
    counts = counts.double()
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    return [int(count) for count in counts.tolist()]
