"""glibc's heap kept between training steps: what a step frees stays in the process for the next step.

glibc gives the top of its heap back to the system when more than M_TRIM_THRESHOLD is free there, and serves blocks
above M_MMAP_THRESHOLD by mmap, unmapped again at free (both dynamic by default: the mmap threshold follows the
largest block freed, up to 32 MB, and the trim threshold is twice it). A training step frees nearly all it allocated
by its end (activations, gradients' temporaries), so the next step takes the same memory from the system again: a
page fault for every 4 KB page, each zeroed by the kernel. HRM's cpu-small step took 2.8-5.1k faults and 4.4-8.4 ms
of system time a step (of ~100); SASRec's step at maxlen 200 and HRM's ran 5-8% faster with the heap kept
(benchmarks/README.md, "glibc's heap"). PyTorch's CPU tuning guide makes the same point by preloading jemalloc or
tcmalloc; on glibc two mallopt calls do it.

So a run's process (`start_run`) sets M_MMAP_THRESHOLD to 1 GiB and M_TRIM_THRESHOLD to 2 GiB - 1: the heap grows to
a step's peak in the first steps and stays there. The cost is that the process keeps the memory of its largest step
(which the next step would take again) until it exits. Nothing is set, and glibc keeps its own choice, where the
user chose: MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_ or MALLOC_MMAP_MAX_ exported, glibc's
malloc tunables in GLIBC_TUNABLES, or another allocator in LD_PRELOAD; nor where the C library is not glibc. No
number a run computes depends on it.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap (and stay there when freed)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt's value is an int: the most it takes
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_kept: bool | None = None  # None: not asked yet


def user_choice() -> str | None:
    """The setting by which the user chose the allocator's behaviour, if any."""
    for name in USER_SETTINGS:
        if name in os.environ:
            return name
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc: libjemalloc.so, libtcmalloc...
        return "LD_PRELOAD"
    return None


def keep_between_steps() -> bool:
    """Set glibc's thresholds so that freed memory stays in the process (once per process); whether they are set.
    False, and nothing changed, where the user chose (user_choice) or the C library is not glibc."""
    global _kept
    if _kept is None:
        _kept = False
        if user_choice() is None:
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.gnu_get_libc_version  # noqa: B018  (glibc's own symbol: musl and others have none)
            except (OSError, AttributeError):
                return False
            mapped = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # mallopt returns 1 where it took the value
            trimmed = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            _kept = mapped == trimmed == 1
    return _kept
