"""`--compile` across a run's lives: inductor's on-disk caches live in the run directory, and the first step says
in one line what compiling cost.

Why the run directory: inductor caches what it compiles under TORCHINDUCTOR_CACHE_DIR, by default
/tmp/torchinductor_$USER, i.e. per machine. A run resumed with `--resume-from auto`, e.g. requeued by SLURM onto
another node, would find that cache empty and pay the cold compile (tens of seconds to minutes) again in every
life. The run directory is the one place every rank of every life sees (Run.begin checks that all machines see it),
so RUN/compile-cache is set on every rank when the run takes it, before the first step compiles; a fresh run
directory starts its own cache.

What torch 2.13 keeps there, all on by default (torch/_inductor/config.py fx_graph_cache, torch/_functorch/config.py
enable_autograd_cache): the FX graph cache (inductor's generated code and the C++ .so / Triton kernels built from
it), the AOTAutograd cache (the traced forward+backward, so a hit skips AOT tracing too), and on GPUs Triton's
kernel cache (TORCHINDUCTOR_CACHE_DIR/triton/<device>, unless TRITON_CACHE_DIR says otherwise). Entries are keyed
by the graph, the torch version, the device and the config, written atomically and guarded by file locks in the
cache: ranks and nodes can share it, and an entry that no longer fits is a miss, never a wrong kernel. Dynamo's
bytecode tracing is not cached, so a warm first step still costs a few seconds.

The directory sits beside checkpoints/, not in it: checkpoint manifests, pruning, leftover cleanup and `verify`
only look under checkpoints/, so the cache is neither damage nor something a later life removes. A
TORCHINDUCTOR_CACHE_DIR the user set (anything but inductor's default) is kept: the line names where it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from toolkit.run.accelerator import ToolkitAccelerator

CACHE_DIR = "compile-cache"
_ENV = "TORCHINDUCTOR_CACHE_DIR"
_chosen: str | None = None  # the cache directory this process set (a later run in the same process replaces it)
_baseline: dict[str, int] = {}  # inductor's cache counters when this life's run started (they are process-wide)


def use_run_cache(run_dir: Path) -> Path:
    """Point inductor's caches at RUN/compile-cache (every rank, from Run.begin). Returns the directory in use,
    which is the user's own when TORCHINDUCTOR_CACHE_DIR was set to something else than inductor's default.

    Called when the run takes its directory, not earlier: torch.compile() itself (Accelerate's prepare) makes the
    cache directory, and a run refused before Run.begin must leave nothing behind. Nothing compiles before then:
    torch.compile only wraps the model; dynamo and inductor work at its first call, the first training step."""
    global _chosen, _baseline
    current = os.environ.get(_ENV)
    # inductor writes its default into the environment when it first looks; a value this process set is ours too
    ours = current is None or os.path.realpath(current) in (os.path.realpath(inductor_default_cache_dir()), _chosen)
    if ours:
        where = os.path.realpath(Path(run_dir) / CACHE_DIR)  # absolute: inductor resolves it when it compiles
        if _chosen and os.environ.get("TRITON_CACHE_DIR", "").startswith(_chosen):
            del os.environ["TRITON_CACHE_DIR"]  # inductor set it under the previous run's cache: follows ours
        os.environ[_ENV] = _chosen = where
        if "torch._inductor.utils" in sys.modules:  # a run before this one in this process memoised its paths
            clear_inductor_caches(sys.modules["torch._inductor.utils"])
    _baseline = _counts()
    return Path(run_dir) / CACHE_DIR if ours else Path(current)


def inductor_default_cache_dir() -> str:
    """Inductor's default TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_$USER: torch 2.6+ has it as
    torch._inductor.runtime.cache_dir_utils.default_cache_dir (read in 2.6's wheel); torch 2.4 computes the same path
    inline in torch._inductor.runtime.runtime_utils.cache_dir(), as here."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        import getpass
        import re
        import tempfile

        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return default_cache_dir()


def clear_inductor_caches(utils) -> None:
    """Forget the paths inductor memoised (torch._inductor.utils, passed in): `clear_caches` in newer torch (2.8,
    2.13), `clear_inductor_caches` in torch 2.4 and 2.6 (read in their wheels: the same loop over the functools caches
    registered with clear_on_fresh_inductor_cache)."""
    clear = getattr(utils, "clear_caches", None) or utils.clear_inductor_caches
    clear()


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {**{k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")},
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def describe_first_step(seconds: float, where: Path | str) -> str:
    """The one line: how long the first step took and whether it compiled (cold) or loaded (warm) its graphs,
    judged from inductor's FX graph cache counters since the run started (one count per compiled graph: the
    forward and the backward are two)."""
    now = _counts()
    hit, miss, bypass = (now[k] - _baseline.get(k, 0) for k in ("hit", "miss", "bypass"))
    graphs = hit + miss + bypass
    took = f"torch.compile: first step took {seconds:.1f} s"
    not_cached = f"; {bypass} graph(s) not cacheable" if bypass else ""
    if graphs == 0:
        if not fx_graph_cache_on():  # the counters count cache lookups: none without the cache (torch 2.4's default)
            return (
                f"{took} (inductor's FX graph cache is off in torch {torch.__version__}: later lives compile "
                "again; TORCHINDUCTOR_FX_GRAPH_CACHE=1 turns it on)"
            )
        return f"{took} (no graph compiled in it)"
    if miss == 0 and hit:
        return f"{took} (cache: warm, {hit} graph(s) reused from {where}{not_cached})"
    state = "cold" if hit == 0 else f"partly warm, {hit} of {graphs} graph(s) reused"
    return f"{took} (compiling {miss + bypass} graph(s); cache: {state}, {where}{not_cached}); later lives reuse it"


def fx_graph_cache_on() -> bool:
    """Whether inductor caches compiled graphs (torch._inductor.config.fx_graph_cache): on by default in torch 2.13,
    off by default in 2.4 (TORCHINDUCTOR_FX_GRAPH_CACHE=1 turns it on)."""
    import torch._inductor.config

    return bool(torch._inductor.config.fx_graph_cache)


def describe_capture() -> str | None:
    """--cuda-graphs, after the first step: one line when inductor left graphs uncaptured (its counter since the run
    started), None when every graph was captured. Why each was not, inductor says under TORCH_LOGS=cudagraphs (a CPU
    op in the graph, an input mutated in place, dynamic shapes, ...); those graphs run compiled, uncaptured."""
    from torch._dynamo.utils import counters

    skipped = counters["inductor"]["cudagraph_skips"] - _baseline.get("cudagraph_skips", 0)
    if not skipped:
        return None
    return (f"--cuda-graphs: {skipped} compiled graph(s) could not be captured and run uncaptured (the reasons: run "
            "with TORCH_LOGS=cudagraphs)")


def first_step_reporter(run):
    """For --compile and --cuda-graphs: a callable the training loop gives the first optimizer step's compute
    seconds; it prints the line(s) (main process) and returns None, so the loop calls it once per life. None
    without either flag."""
    if not (run.config.compile or run.model_graphs):
        # (a whole captured step compiles nothing without --compile: toolkit.run.step_graph says its own line)
        return None

    def report(seconds: float) -> None:
        if run.is_main:
            from tqdm.auto import tqdm

            where = os.environ.get(_ENV) or "?"  # set by Run.begin, after the loop was made
            shown = run.output_dir / CACHE_DIR if os.path.realpath(where) == _chosen else where  # the path as given
            tqdm.write(describe_first_step(seconds, shown))  # between progress-bar redraws
            if run.model_graphs and (uncaptured := describe_capture()):
                tqdm.write(uncaptured)
            sys.stdout.flush()

    return report


def step_marker(run):
    """--cuda-graphs: torch.compiler.cudagraph_mark_step_begin, for the loop to call before each micro-batch (a new
    iteration: the graphs' outputs of the previous one may be overwritten; the loop's losses are copies). None
    without the flag."""
    return torch.compiler.cudagraph_mark_step_begin if run.model_graphs else None


class CompilingAccelerator(ToolkitAccelerator):
    """The Accelerator of a --compile run: prepare() compiles the model in place (as nn.Module.compile does; inductor)
    before DDP wraps it, instead of Accelerate's dynamo_backend, which compiles the wrapper. Compiling the DDP wrapper
    compiled nothing on torch 2.13: dynamo breaks the graph at DDP's pre-forward logging
    (Logger.set_runtime_stats_and_log) and DDP's own frames are in its skip list, so every step ran eagerly with 2+
    processes and said `no graph compiled`. Compiled in place, the module's forward (and its backward) is what
    dynamo sees on any process count, DDP's gradient hooks fire on the compiled backward's gradients as on eager
    ones, and the state_dict keeps its names (no `_orig_mod.` prefix): a compiled run's weights files read as an
    uncompiled run's do (load_best, toolkit.export)."""

    def __init__(self, *args, compile_mode: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.compile_mode = compile_mode  # "reduce-overhead": --cuda-graphs capturing the model's graphs
        # False: --cuda-graphs capturing the whole step, without --compile (toolkit.run.step_graph)
        self.compiles = True

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if self.compiles:
            compile_in_place(model, mode=self.compile_mode)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)


def compile_in_place(model: torch.nn.Module, mode: str | None = None) -> None:
    """nn.Module.compile() with the call traced from a frame of ours: Module.compile compiles `_call_impl` itself,
    whose file dynamo skips, so a model whose forward is also torch's (an nn.Sequential) compiled nothing on torch
    2.13; traced from here, `_call_impl` and every forward under it are inlined into one graph (as
    torch._dynamo.external_utils.wrap_inline does for torch.compile(module))."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return

    def call(*args, **kwargs):
        return model._call_impl(*args, **kwargs)

    model._compiled_call_impl = torch.compile(call, backend="inductor", mode=mode)
