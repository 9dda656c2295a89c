"""The toolkit's modules import each other without a cycle, and the leaves stay leaves; failures map to exit codes.

The walk reads every import statement of every module (those inside functions too: a lazy import is still a
dependency), so a cycle cannot hide behind a function-level import."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

LEAVES = ("toolkit.errors", "toolkit.console", "toolkit.run.rundir")  # imported widely: they import nothing of ours


def toolkit_imports() -> dict[str, set[str]]:
    graph = {}
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        package = name if is_package else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: the package, less (level - 1) parts, then the module
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in node.names:  # `from toolkit import checkpoint` names a module
                    targets.add(f"{base}.{alias.name}")
                targets.add(base)
        graph[name] = targets
    modules = set(graph) - {"toolkit"}

    def ancestor(package: str, name: str) -> bool:  # a module imports its packages anyway, before its own code runs
        return name.startswith(f"{package}.")

    return {name: {t for t in targets if t in modules and t != name and not ancestor(t, name)}
            for name, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_walk_sees_lazy_and_package_imports():
    graph = toolkit_imports()
    assert len(graph) > 30
    assert "toolkit.process.shutdown" in graph["toolkit.process.entry"]  # a module-level import
    assert "toolkit.run.distributed" in graph["toolkit.process.entry"]  # a function-level one
    assert "toolkit.process.preemption" in graph["toolkit.loop.training"]  # `from toolkit import preemption`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_anywhere_in_the_toolkit():
    assert cycles(toolkit_imports()) == []


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_leaves_import_nothing_of_the_toolkit(leaf):
    assert toolkit_imports()[leaf] == set()


def test_bad_input_exits_2_and_a_runtime_failure_exits_1_in_one_line(capfd):
    from toolkit.errors import RunFailed, TrainingStopped, UsageError
    from toolkit.process.entry import one_line_errors

    for error, status in ((UsageError("--lr -1 is invalid"), 2), (RunFailed("no space left"), 1),
                          (TrainingStopped("the training loss is nan at step 3"), 1)):

        @one_line_errors
        def main(error=error):
            raise error

        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == status
        assert capfd.readouterr().err.splitlines() == [f"error: {error}"]


def test_what_a_run_writes_names_each_file_of_the_layout():
    """The docs' "What a run writes" (docs/checkpoints.md) names every file toolkit.run.rundir names (model.safetensors
    was missing)."""
    from toolkit.run import rundir

    page = (ROOT / "docs" / "checkpoints.md").read_text()
    section = page[page.index("## What a run writes"):]
    section = section[:section.index("\n## ", 1)]
    names = [value for key, value in vars(rundir).items() if key.endswith(("_FILE", "_DIR")) and isinstance(value, str)]
    assert "model.safetensors" in names and [name for name in names if name not in section] == []


def test_the_run_directory_layout_is_named_once():
    """No module of the toolkit spells a run directory's file names itself: they come from toolkit.run.rundir."""
    names = ('"config.json"', '"summary.json"', '"metrics.csv"', '"log.csv"', '"model.safetensors"')
    spelled = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "toolkit").rglob("*.py"))
               if path.name != "rundir.py" for name in names if name in path.read_text()]
    assert spelled == []


IMPORT_EVERY_MODULE = """
import atexit, json, os, pkgutil, signal, sys, threading
handlers = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)}
environ, threads, hooks = dict(os.environ), threading.active_count(), []
register = atexit.register  # the libraries toolkit imports register their own hooks: ours are what counts
def recording(func, *args, **kwargs):
    hooks.append(getattr(func, "__module__", "") or "")
    return register(func, *args, **kwargs)
atexit.register = recording
import importlib, toolkit
failed = []
for module in pkgutil.walk_packages(toolkit.__path__, "toolkit."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except ImportError as error:  # an optional extra (netCDF, HDF5, matplotlib) may be missing: not a side effect
        failed.append(f"{module.name}: {error}")
after = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)}
print(json.dumps({
    "signals": {name: [handlers[name], after[name]] for name in handlers if handlers[name] != after[name]},
    "environ": sorted(set(os.environ.items()) ^ set(environ.items())),
    "threads": [threading.active_count(), threads], "exit_hooks": [h for h in hooks if h.startswith("toolkit")],
    "modules": sum(1 for name in sys.modules if name.startswith("toolkit")), "failed": failed,
}))
"""


def test_importing_every_toolkit_module_changes_nothing_in_the_process():
    """A notebook or another program that imports a helper gets no signal handler, environment variable, thread or
    exit hook: those come from begin_process() and start_run() (toolkit.process)."""
    import json
    import subprocess
    import sys

    from tests.conftest import recipe_env

    env = {k: v for k, v in recipe_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["TORCHELASTIC_RUN_ID"] = "as-under-a-launcher"  # the launcher watch would start here, were it imported
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True, timeout=300)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["modules"] > 40 and seen["failed"] == [], seen
    assert seen["signals"] == {} and seen["environ"] == [], seen
    assert seen["threads"][0] == seen["threads"][1] and seen["exit_hooks"] == [], seen


def test_begin_process_installs_what_an_import_no_longer_does():
    import json
    import subprocess
    import sys

    from tests.conftest import recipe_env

    script = ("import json, os, signal; from toolkit.process import begin_process; begin_process(); "
              "print(json.dumps([repr(signal.getsignal(signal.SIGUSR1)), repr(signal.getsignal(signal.SIGTERM)), "
              "os.environ.get('OMP_WAIT_POLICY') or os.environ.get('GOMP_SPINCOUNT')]))")
    env = {k: v for k, v in recipe_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    usr1, term, policy = json.loads(done.stdout)
    assert "_remember" in usr1 and "_stop_before_the_run" in term and policy in ("PASSIVE", "1000"), done.stdout


def private_reads(paths) -> list[str]:
    """`from toolkit.x import _name` and `name._attr` where `name` was imported from the toolkit (a module, a class or
    a function of it), in the given files."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("toolkit"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in imported):
                found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_names(tmp_path):
    """The toolkit's modules and the recipes use each other's public names only (loop.py read
    preemption._requested, keeper.py imported run._config_values, the HRM model randomness._mix32)."""
    files = sorted((ROOT / "toolkit").rglob("*.py")) + sorted((ROOT / "recipes").glob("*.py"))
    assert private_reads(files) == []
    planted = tmp_path / "planted.py"  # the check sees a private read where there is one
    planted.write_text("from toolkit.process import preemption\nfrom toolkit.run.start import _shared\n"
                       "if preemption._requested:\n    pass\n")
    assert private_reads([planted]) == ["planted.py:2: from toolkit.run.start import _shared",
                                        "planted.py:3: preemption._requested"]


def test_the_docs_layout_names_every_module():
    import re

    page = (ROOT / "docs" / "development.md").read_text()
    layout = page[page.index("## Layout"):]
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "toolkit").rglob("*.py"))
               if path.stem != "__init__" and not re.search(rf"\b{re.escape(path.stem)}\b", layout)]
    assert missing == [], f"name these in docs/development.md's Layout: {missing}"


def loop_reads(paths: list) -> list[str]:
    """`loop.NAME` in the given files where NAME is not the loop's public API: a method or property that
    TrainingLoop (or a base) defines and does not mark private. Its parts (progress, evaluations, keeper, losses)
    are instance attributes, not API."""
    import inspect

    from toolkit.loop.training import TrainingLoop

    public = {name for cls in inspect.getmro(TrainingLoop) for name in vars(cls) if not name.startswith("_")}
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "loop"
                    and node.attr not in public):
                found.append(f"{path.name}:{node.lineno}: loop.{node.attr}")
    return found


def test_recipes_use_the_loops_public_api_only(tmp_path):
    """HRM's recipe stepped its two optimizers by hand and read loop.progress and loop.evaluations; now
    optimizer_step takes several optimizers, and global_step, best_step and evaluate_now are the loop's own."""
    files = [*sorted((ROOT / "recipes").glob("*.py")), *sorted((ROOT / "examples").glob("*.py")),
             ROOT / "tests" / "toy_recipe.py"]
    assert loop_reads(files) == []
    planted = tmp_path / "planted.py"
    planted.write_text("step = loop.progress.global_step\nloop.optimizer_step(o, loss=x)\nloop.evaluations.row = 1\n")
    assert loop_reads([planted]) == ["planted.py:1: loop.progress", "planted.py:3: loop.evaluations"]


def test_every_module_is_core_or_family_in_the_import_contract():
    """pyproject.toml's import-linter contract names each toolkit module once: a source (the core, which may import
    no family) or a forbidden one (a family's); a new module outside both would escape the check (make test runs
    lint-imports). Model files import no kernel (the second contract)."""
    tomllib = pytest.importorskip("tomllib")
    contracts = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
                 ["contracts"]}
    core = contracts["core-knows-no-family"]
    modules = set()
    for path in (ROOT / "toolkit").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    sources, forbidden = set(core["source_modules"]), set(core["forbidden_modules"])
    assert not sources & forbidden, sources & forbidden
    assert sources | forbidden == modules, {"unnamed": modules - sources - forbidden,
                                            "gone": (sources | forbidden) - modules}
    assert all(name.startswith(("toolkit.models", "toolkit.export", "toolkit.data.", "toolkit.kernels."))
               for name in forbidden)
    assert contracts["models-are-plain"]["forbidden_modules"] == ["toolkit.kernels"]
