"""Older torch releases: each feature with a floor refuses below it in one line (the version it reads monkeypatched
here), and --compile's inductor calls find the APIs where torch 2.4 to 2.6 kept them (their modules stubbed here)."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from conftest import dir_tree

from toolkit.errors import UsageError
from toolkit.export import main as export_main
from toolkit.process.torch_floor import AOTI, require_torch, torch_release
from toolkit.run import compilation


def run_export(argv: list[str], capfd) -> tuple[int, str, str]:
    try:
        export_main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capfd.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("version", ["2.4.1", "2.5.1+cu121"])
def test_aoti_below_its_floor_is_one_line_before_anything_is_read_or_made(version, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    run_dir = tmp_path / "run"  # not even a run: the floor is checked first, before the run is read
    run_dir.mkdir()
    before = dir_tree(tmp_path)
    for argv in (
        ["aoti", str(run_dir), "--out", str(tmp_path / "out" / "emulator.pt2")],
        [
            "predict",
            "--model",
            str(tmp_path / "emulator.pt2"),
            "--data",
            str(tmp_path / "in.nc"),
            "--out",
            str(tmp_path / "out.nc"),
        ],
    ):
        code, out, err = run_export(argv, capfd)
        assert code == 2 and out == "", (out, err)
        assert len(err.splitlines()) == 1, err
        assert err.startswith("error: ") and f"needs torch >= 2.6 (this is {version}); pip install 'torch>=2.6'" in err
        assert dir_tree(tmp_path) == before  # nothing made


def test_release_comparison_reads_minor_versions_as_numbers(monkeypatch):
    assert torch_release("2.13.0+cpu") == (2, 13) and torch_release("2.6.0a0+git1234") == (2, 6)
    for version in ("2.6.0", "2.10.0", "2.15.0", "3.0.0"):  # 2.10 is newer than 2.6, not older (string order)
        monkeypatch.setattr(torch, "__version__", version)
        require_torch(AOTI, "x", "y")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(UsageError, match=r"^x needs torch >= 2\.6 \(this is 2\.5\.1\); y$"):
        require_torch(AOTI, "x", "y")


def test_inductor_default_cache_dir_where_torch_2_4_has_no_cache_dir_utils(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    expected = default_cache_dir()
    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.cache_dir_utils", None)  # import raises ImportError
    assert compilation.inductor_default_cache_dir() == expected


def test_run_cache_on_torch_2_4_to_2_6_apis(tmp_path, monkeypatch):
    """use_run_cache with neither cache_dir_utils (torch 2.4) nor utils.clear_caches (2.4 and 2.6, where it is
    clear_inductor_caches): the run's cache is taken and the memoised paths are cleared through the old name."""
    cleared = []
    old_utils = types.SimpleNamespace(clear_inductor_caches=lambda: cleared.append(True))
    monkeypatch.setitem(sys.modules, "torch._inductor.runtime.cache_dir_utils", None)
    monkeypatch.setitem(sys.modules, "torch._inductor.utils", old_utils)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(compilation, "_chosen", None)
    monkeypatch.setattr(compilation, "_baseline", {})
    where = compilation.use_run_cache(tmp_path / "run")
    assert where == tmp_path / "run" / compilation.CACHE_DIR and cleared == [True]
    assert compilation._chosen == str((tmp_path / "run" / compilation.CACHE_DIR).resolve())
    new_utils = types.SimpleNamespace(clear_caches=lambda: cleared.append("new"))  # torch 2.7+
    monkeypatch.setitem(sys.modules, "torch._inductor.utils", new_utils)
    compilation.use_run_cache(tmp_path / "second")  # the previous run's cache is ours: replaced
    assert cleared == [True, "new"] and compilation._chosen.endswith("second/compile-cache")


def test_first_step_line_where_the_fx_graph_cache_is_off(monkeypatch):
    """torch 2.4's default: no FX graph cache, so no cache counts; the line says so instead of `no graph compiled`."""
    import torch._inductor.config

    monkeypatch.setattr(compilation, "_baseline", compilation._counts())
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    line = compilation.describe_first_step(12.0, "/runs/x/compile-cache")
    assert "FX graph cache is off" in line and "TORCHINDUCTOR_FX_GRAPH_CACHE=1" in line
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", True)
    assert compilation.describe_first_step(12.0, "/runs/x/compile-cache").endswith("(no graph compiled in it)")


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_torchscript_deprecation_is_silenced_inside_the_export_only(category):
    """torch 2.13 warns with a DeprecationWarning for torch.jit calls, newer releases with a FutureWarning (the same
    message): both are silenced inside quiet_torchscript; other warnings, and the same one outside, still show."""
    from toolkit.export.torchscript import quiet_torchscript

    message = "`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_torchscript():
            warnings.warn(message, category, stacklevel=1)
            warnings.warn("something else is deprecated", category, stacklevel=1)
        warnings.warn(message, category, stacklevel=1)
    assert [(w.category, str(w.message)) for w in seen] == [
        (category, "something else is deprecated"),
        (category, message),
    ]
