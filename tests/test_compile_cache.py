"""--compile across a run's lives: inductor's caches live in RUN/compile-cache, so a life resumed with
`--resume-from auto` loads its graphs (warm) where the first life compiled them (cold); the cache is not damage to
`verify`, survives the resume's cleanup, a fresh run directory starts its own, and the resumed run ends with the
bytes of an uninterrupted compiled run. One line per life says what the first step cost. Tiny toy model (inductor
compiles C++ with g++ on CPU: two graphs, forward and backward, ~10 s cold on 2 busy cores)."""

import os
import re

import pytest
from conftest import TOY, read_json, run_recipe

from toolkit.run import compilation
from toolkit.tools.verify import verify_run

# No dropout: keyed dropout's seed is a Python int, a graph break (more graphs, longer compiles, the same test).
ARGS = ["--compile", "--dropout", "0", "--eval-every-steps", "3", "--log-with", "csv", "--log-every", "1"]
# Inductor compiles in this process instead of starting its pool of compile workers (processes): less CPU on 2 cores.
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
LINE = re.compile(r"^torch\.compile: first step took (\d+\.\d) s \((.*)\)(; later lives reuse it)?$", re.MULTILINE)


def first_step_line(stdout: str) -> tuple[str, bool]:
    """(what the parentheses say, whether it promises reuse): exactly one such line per life."""
    found = LINE.findall(stdout)
    assert len(found) == 1, stdout
    return found[0][1], bool(found[0][2])


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, "cpu_2proc.yaml"], ids=["1proc", "2proc"])
def test_resumed_compiled_run_reuses_its_run_dir_cache_and_matches_an_uninterrupted_one(config, tmp_path,
                                                                                       monkeypatch):
    # 2 processes: the model is compiled before DDP wraps it (toolkit.run.compilation.CompilingAccelerator);
    # Accelerate's
    # compiled DDP wrapper compiled no graph on torch 2.13 and the line said so. The toy is an nn.Sequential, whose
    # nn.Module.compile() compiles nothing either: the same 2 graphs must show on both counts of processes.
    # Inductor's own default (or a user's choice) would hide whether the run directory holds the cache.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"

    first = run_recipe([*ARGS, "--max-steps", "3", "--output-dir", str(resumed)], recipe=TOY, env=ENV, config=config)
    said, promise = first_step_line(first.stdout)
    assert said.startswith("compiling 2 graph(s); cache: cold, ") and promise, said
    assert said.endswith(str(resumed / "compile-cache")), said
    cache = resumed / "compile-cache"
    entries = {p.relative_to(cache).parts[0] for p in cache.rglob("*") if p.is_file()}
    assert {"fxgraph", "aotautograd"} <= entries, entries  # the FX graph and AOTAutograd caches, on by default

    second = run_recipe([*ARGS, "--max-steps", "6", "--output-dir", str(resumed), "--resume-from", "auto"],
                        recipe=TOY, env=ENV, config=config)
    assert "resuming from" in second.stdout and "step_3" in second.stdout
    said, promise = first_step_line(second.stdout)
    # warm = inductor's FX graph cache hit both graphs and missed none (its counters since the life started)
    assert said == f"cache: warm, 2 graph(s) reused from {cache}" and not promise, said
    assert verify_run(resumed) == []  # the cache beside checkpoints/ is not damage, nor a leftover
    assert read_json(resumed / "summary.json")["global_step"] == 6

    # A fresh run directory compiles into its own cache (cold), and the lives add up to the uninterrupted run:
    # the resumed life ran the very kernels the straight run compiled (same graphs, same generated code).
    third = run_recipe([*ARGS, "--max-steps", "6", "--output-dir", str(straight)], recipe=TOY, env=ENV, config=config)
    said, _ = first_step_line(third.stdout)
    assert said == f"compiling 2 graph(s); cache: cold, {straight / 'compile-cache'}", said
    step_6 = [d / "checkpoints" / "step_6" / "model.safetensors" for d in (resumed, straight)]
    assert step_6[0].read_bytes() == step_6[1].read_bytes()
    world = 2 if config else 1
    assert read_json(straight / "config.json")["world_sizes"] == [{"from_step": 0, "world_size": world}]
    from safetensors import safe_open

    with safe_open(str(step_6[0]), "pt") as saved:  # compiled in place: the uncompiled model's names, no _orig_mod
        assert not [name for name in saved.keys() if "_orig_mod" in name] and "0.weight" in saved.keys()
    rows = [[line.split(",")[:4] for line in (d / "metrics.csv").read_text().splitlines()] for d in (resumed, straight)]
    assert rows[0] == rows[1] and len(rows[0]) == 3  # epoch, step, train loss, val_mse of both lives' rows


def test_run_cache_replaces_inductors_default_and_keeps_a_users_choice(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(compilation, "_chosen", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes when it first looks
    assert compilation.use_run_cache(tmp_path / "a") == tmp_path / "a" / "compile-cache"
    assert compilation.use_run_cache(tmp_path / "b") == tmp_path / "b" / "compile-cache"  # a later run: its own
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "b" / "compile-cache").resolve())
    assert not (tmp_path / "b").exists()  # only the variable: inductor makes the directory when it compiles
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compilation.use_run_cache(tmp_path / "c") == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize(("hit", "miss", "bypass", "said"), [
    (0, 2, 0, "(compiling 2 graph(s); cache: cold, RUN/compile-cache); later lives reuse it"),
    (2, 0, 0, "(cache: warm, 2 graph(s) reused from RUN/compile-cache)"),
    (1, 1, 0, "(compiling 1 graph(s); cache: partly warm, 1 of 2 graph(s) reused, RUN/compile-cache); later lives"),
    (2, 0, 1, "(cache: warm, 2 graph(s) reused from RUN/compile-cache; 1 graph(s) not cacheable)"),
    (0, 0, 0, "(no graph compiled in it)"),
])
def test_the_line_reads_inductors_cache_counters(hit, miss, bypass, said, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compilation, "_baseline", compilation._counts())  # counters are process-wide: a delta
    before = dict(counters["inductor"])
    try:
        for name, count in (("hit", hit), ("miss", miss), ("bypass", bypass)):
            counters["inductor"][f"fxgraph_cache_{name}"] += count
        line = compilation.describe_first_step(41.24, "RUN/compile-cache")
    finally:
        counters["inductor"].clear()
        counters["inductor"].update(before)
    assert line.startswith("torch.compile: first step took 41.2 s ") and said in line, line
