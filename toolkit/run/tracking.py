"""What a run records: trackers (W&B, TensorBoard, a CSV log), metrics.csv, summary.json and curves.png.

Everything here writes from the main process only; metrics arrive already reduced over all ranks.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import netrc
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker

from toolkit.errors import UsageError
from toolkit.process import extras
from toolkit.run.rundir import LOG_FILE, METRICS_FILE

CURVES_FILE = "curves.png"

# metrics.csv columns around the recipe's own validation metrics (which go between train_loss and the timings).
LEADING_COLUMNS = ["epoch", "step", "train_loss"]
TRAILING_COLUMNS = [
    "epoch_time_sec",
    "throughput_samples_per_sec",
    "data_load_time_sec",
    "compute_time_sec",
    "cpu_util_avg",
    "gpu_util_avg",
    "peak_memory_mb",
    "world_size",
]
# Columns added after runs had been written: verify does not require them, and a resumed older run keeps its header.
OPTIONAL_COLUMNS = {"peak_memory_mb"}


class CSVTracker(GeneralTracker):
    """`--log-with csv`: every logged value as a `step,name,value` row of log.csv in the run directory."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, run_dir: Path):
        super().__init__()
        self.path = Path(run_dir) / LOG_FILE

    @property
    def tracker(self):
        return self.path

    def log(self, values: dict, step: int | None = None, **kwargs):
        new = _is_new(self.path)
        try:
            with open(self.path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["step", "name", "value"])
                for name, value in values.items():
                    writer.writerow([step, name, repr(value) if isinstance(value, float) else value])
        except OSError as error:  # a full disk: one line naming it (a resume cuts the file back to its checkpoint)
            from toolkit.run.checkpoint import disk_error  # here: it imports torch and accelerate's state

            raise disk_error(error, self.path) from None


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def tracker_choice(log_with: str, run_dir: Path, is_main: bool) -> list | None:
    """What to pass as Accelerator(log_with=...). Makes W&B offline when it has no credentials."""
    if log_with == "none":
        return None
    if log_with == "csv":
        return [CSVTracker(run_dir)]
    if log_with == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                raise UsageError(
                    "--log-with tensorboard needs the tensorboard package (pip install tensorboard); "
                    "or use --log-with wandb, csv or none"
                ) from None
        return ["tensorboard"]
    # wandb writes its debug logs through Python's logging into the run directory: on a full disk each record would
    # print "--- Logging error ---" and a traceback (dozens, before the run's own one line about the disk). Records
    # a handler cannot write are dropped quietly instead; the toolkit's own writes still stop the run in one line.
    logging.raiseExceptions = False
    if "WANDB_MODE" not in os.environ and not wandb_has_credentials():
        os.environ["WANDB_MODE"] = "offline"
        if is_main:
            print(
                f"wandb: no W&B credentials found, logging offline under {run_dir}/wandb; "
                f"upload later with: wandb sync {run_dir}/wandb/offline-run-*",
                flush=True,
            )
    return ["wandb"]


def tracker_init_kwargs(run_dir: Path, run_name: str, run_id: str) -> dict:
    # The same id with resume="allow" makes a resumed run continue the same W&B run.
    return {"wandb": {"dir": str(run_dir), "name": run_name, "id": run_id, "resume": "allow"}}


class MetricsFile:
    """metrics.csv: one row per evaluation; the columns are fixed by the first row written."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, newline="") as handle:
            return list(csv.DictReader(handle))

    def append(self, row: dict) -> None:
        new = _is_new(self.path)
        columns = list(row)
        if not new:
            with open(self.path, newline="") as handle:
                columns = list(csv.DictReader(handle).fieldnames or row)
        with open(self.path, "a", newline="") as handle:
            # A file written before a column was added keeps its header: the row's extra columns are left out.
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def _is_new(path: Path) -> bool:
    """Whether an append-only CSV still needs its header: missing, or empty (a resume from a checkpoint saved before
    its first row cuts it to 0 bytes; a kill between open and the header's write leaves it empty)."""
    try:
        return path.stat().st_size == 0
    except FileNotFoundError:
        return True


def truncate_to_bytes(path: Path, size: int) -> None:
    """On resume, cut an append-only file (metrics.csv, log.csv) back to its length when the checkpoint was saved:
    whatever a later life wrote after it (rows, test results) is written again by the resumed run, once. A file
    that did not exist then is removed, so the next row writes its header again."""
    path = Path(path)
    if path.exists() and path.stat().st_size > size:
        if size == 0:
            path.unlink()
        else:
            os.truncate(path, size)


def write_json(path: Path, data: dict) -> None:
    """path = data as JSON, written to a temporary sibling and renamed; a failed write removes the sibling."""
    tmp = Path(str(path) + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        tmp.replace(path)
    except OSError as error:  # a write that failed names no file: this one
        raise _naming(error, path) from None
    finally:
        tmp.unlink(missing_ok=True)


def save_png(figure, path: Path, dpi: int) -> None:
    """Write the figure to `path` whole or not at all (a full disk leaves no half-written picture: it is drawn into a
    partial file beside it, renamed once complete, removed otherwise) and close it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial.png")
    try:
        figure.savefig(partial, dpi=dpi, format="png")
        partial.replace(path)
    finally:
        extras.pyplot().close(figure)
        partial.unlink(missing_ok=True)


def _naming(error: OSError, path: Path) -> OSError:
    return error if error.filename else OSError(error.errno, error.strerror, str(path))


def plot_curves(run_dir: Path, main_metric: str) -> Path | None:
    """curves.png: training loss and the main validation metric against the optimizer step."""
    rows = MetricsFile(run_dir).rows()
    if not rows:
        return None
    plt = extras.pyplot()

    def series(name):
        points = [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in ("", None)]
        return [p[0] for p in points], [p[1] for p in points]

    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(*series("train_loss"), marker="o", markersize=3)
    ax_loss.set(xlabel="optimizer step", ylabel="train loss", title="Training loss (epoch mean)")
    if main_metric in rows[0]:
        ax_metric.plot(*series(main_metric), marker="o", markersize=3, color="tab:green")
    ax_metric.set(xlabel="optimizer step", ylabel=main_metric, title=f"Validation {main_metric}")
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(run_dir) / CURVES_FILE
    try:
        save_png(fig, path, dpi=110)
    except OSError as error:
        raise _naming(error, path) from None
    return path


def format_table(title: str, metrics: dict) -> str:
    """A small aligned table for the console."""
    width = max(len(k) for k in metrics) if metrics else 0
    lines = [title, "-" * max(len(title), width + 12)]
    for name, value in metrics.items():
        shown = f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)
        lines.append(f"{name:<{width}}  {shown:>10}")
    return "\n".join(lines)
