"""The step meter: what the loop measures between two metrics rows, and the progress bar.

Time is split into fetching batches and computing steps; samples are counted; GPU utilisation (NVML) is read at most
once a second on a CUDA run; the bar's postfix is formatted only as often as tqdm may draw it. timing_columns()
gives a metrics row its timing, throughput, utilisation and memory columns; new_interval() starts the next."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil
import torch
from tqdm.auto import tqdm

GPU_SAMPLE_SEC = 1.0  # at most one GPU utilisation reading (NVML) a second
WAITING_WINDOW_SEC = 60.0  # a CUDA run's first minute of training: is the GPU mostly waiting for the host?
WAITING_BELOW = 30.0  # percent busy


@dataclass
class IntervalTimer:
    """Time and samples since the last metrics row (an epoch, several, or --eval-every-steps steps)."""

    started: float = field(default_factory=time.perf_counter)
    data_sec: float = 0.0
    compute_sec: float = 0.0
    samples: int = 0
    gpu_util: list = field(default_factory=list)
    gpu_sampled_at: float = float("-inf")


class StepMeter:
    def __init__(self, device: torch.device, show_bar: bool, say=None, utilisation=None, clock=time.perf_counter):
        """say(line): where the one-line notice that the GPU waits goes (None: nowhere); utilisation() and clock():
        NVML's reading and the time (stand-ins in tests)."""
        self.device = device
        self.show_bar = show_bar  # the main process draws the bar
        self.reads_gpu_utilisation = device.type == "cuda"  # decided once, not looked up every step
        self.say, self.utilisation, self.clock = say, utilisation or gpu_utilisation, clock
        self.first_minute: list[float] = []  # utilisation readings of the first WAITING_WINDOW_SEC of training
        self.first_reading_at: float | None = None
        self.timer = IntervalTimer()
        self.bar = None
        self._postfix_at = float("-inf")  # when the bar's postfix was last formatted

    # ---- the bar ----
    def open_bar(self, total: int, initial: int, desc: str) -> None:
        if self.show_bar and self.bar is None:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    # ---- the interval ----
    def begin_epoch(self) -> None:
        psutil.cpu_percent()  # starts the CPU-utilisation window
        if self.timer.samples == 0:  # the interval's time starts with its training, not with a save before it
            self.timer = IntervalTimer()

    def fetched(self, seconds: float) -> None:
        self.timer.data_sec += seconds

    def computed(self, samples: int, seconds: float) -> None:
        self.timer.samples += samples
        self.timer.compute_sec += seconds

    def stepped(self, epoch: int, step_loss: float) -> None:
        """After an optimizer step: the bar (and its postfix, when it may be drawn) and, on CUDA, utilisation."""
        bar = self.bar
        if bar is not None and not bar.disable:  # (disabled, e.g. TQDM_DISABLE: no mininterval)
            now = time.perf_counter()
            # The postfix is formatted only as often as tqdm may draw it (mininterval), and never forces a redraw
            # (set_postfix's default): a redraw every step costs ~20 us and writes a line per step into a log file.
            if now - self._postfix_at >= bar.mininterval:
                self._postfix_at = now
                rate = self.timer.samples / max(now - self.timer.started, 1e-9)
                bar.set_postfix(epoch=epoch, loss=f"{step_loss:.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
            bar.update(1)
        if self.reads_gpu_utilisation:
            # NVML averages utilisation over its own sample period (1/6 s to 1 s): one reading a second is all there
            # is to read, and asking every step cost the step time of tiny models on the GPU
            now = self.clock()
            if now - self.timer.gpu_sampled_at >= GPU_SAMPLE_SEC:
                self.timer.gpu_sampled_at = now
                reading = self.utilisation()
                self.timer.gpu_util.append(reading)
                self._watch_first_minute(now, reading)

    def _watch_first_minute(self, now: float, reading: float | None) -> None:
        """Once the first minute of training is read: if the GPU was busy under WAITING_BELOW percent of it, one line
        says so and what to try (the step is the host's time: launches, syncs, the loader)."""
        if self.first_reading_at is None:
            self.first_reading_at = now
        if reading is not None and self.first_minute is not None:
            self.first_minute.append(reading)
        if self.first_minute is None or now - self.first_reading_at < WAITING_WINDOW_SEC:
            return
        readings, self.first_minute = self.first_minute, None  # said at most once
        if readings and self.say is not None:
            busy = sum(readings) / len(readings)
            if busy < WAITING_BELOW:
                self.say(f"the GPU was busy {busy:.0f}% of the first minute: it waits for the host (kernel launches, "
                         "syncs, the loader); try a larger per-GPU batch (--batch-size), --cuda-graphs, or several "
                         "runs at once on the device (python -m toolkit sweep ... --runs-per-device N)")

    def interval_seconds(self) -> float:
        return time.perf_counter() - self.timer.started

    @property
    def timed(self) -> bool:
        """Anything trained in this interval (nothing, right after a resume at an evaluation step)."""
        return self.timer.samples > 0

    def timing_columns(self, interval: float) -> dict:
        """A metrics row's measured columns for an interval of `interval` seconds of training."""
        timer, timed = self.timer, self.timed
        util = [u for u in timer.gpu_util if u is not None]
        return {
            "epoch_time_sec": round(interval, 4) if timed else None,
            "throughput_samples_per_sec": round(timer.samples / max(interval, 1e-9), 2) if timed else None,
            "data_load_time_sec": round(timer.data_sec, 4) if timed else None,
            "compute_time_sec": round(timer.compute_sec, 4) if timed else None,
            "cpu_util_avg": psutil.cpu_percent(),
            "gpu_util_avg": round(sum(util) / len(util), 1) if util else None,
            "peak_memory_mb": peak_memory_mb(self.device),
        }

    def new_interval(self) -> None:
        self.timer = IntervalTimer()


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held so far: on a GPU, what PyTorch's allocator handed out on it (the
    figure that must fit on the card); on the CPU, the process's peak resident set (Linux: ru_maxrss in KiB)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def gpu_utilisation() -> float | None:
    try:
        return float(torch.cuda.utilization())
    except Exception:  # needs pynvml / NVML; the column stays empty without it
        return None
