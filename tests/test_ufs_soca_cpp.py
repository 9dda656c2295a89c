"""SOCA's loading path in C++: export/cpp/soca_icenet.cpp loads the two files of `python -m toolkit.export
torchscript RUN --format soca` as SOCA's BaseEmul.h loads IceNet (make_shared, initWeights, torch::load, loadNorm)
and runs forward and jac one float32 point at a time as IceEmul.h's predict calls them (IceNet's jac: from_blob and
backward); it prints the aice and Jacobian that Python's model computes, to float32 rounding, and that IceNet
transcribed in Python computes, bit for bit. ufs_emulator --format soca loads them the same way, --format ufsnet our
MLP through ufs_net.h. Built as tests/test_ufs_export.py builds export/cpp (skipped with cmake's reason where LibTorch
cannot be configured)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_ufs_export import best_model, build_cpp_consumer
from test_ufs_soca import (
    HIDDEN,
    UFSNET_META,
    export_soca_files,
    soca_points,
    train_soca_run,
    ufsnet_model,
    ufsnet_points,
)

from toolkit.data.ufs import DEFAULT_INPUTS
from toolkit.export.soca import SocaMoments, normalization_path, read_soca, read_tensor_vector, write_ufsnet
from toolkit.export.torchscript import quiet_torchscript
from toolkit.models.ufs_emulator import ICENET_INPUTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ufs-export")]  # with test_ufs_export: one C++ build


@pytest.fixture(scope="module")
def soca_run(tmp_path_factory):
    return train_soca_run(tmp_path_factory.mktemp("ufs-soca-cpp"))


@pytest.fixture(scope="module")
def soca_files(soca_run):
    return export_soca_files(soca_run[0])


def require_compilers() -> None:
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (make test installs them; apt-get install cmake g++)")


def write_points(path: Path, names, x: torch.Tensor) -> Path:
    path.write_text(",".join(names) + "\n" + "".join(",".join(repr(v) for v in row) + "\n" for row in x.tolist()))
    return path


def icenet_in_python(model_path: Path, x: torch.Tensor) -> torch.Tensor:
    """IceNet.h's forward and jac transcribed in Python on SOCA's two files: float32, one point at a time, the
    normalisation by the normalization file's moments; [n, 1 + inputs] (aice, then d aice / d input)."""
    tensors, moments, _ = read_soca(model_path)
    rows = []
    for point in x.float():
        xp = point.clone().requires_grad_(True)
        z = (xp - moments[0]) / moments[1]
        y = torch.sigmoid(F.linear(F.linear(z, tensors["fc1.weight"], tensors["fc1.bias"]), tensors["fc2.weight"],
                                   tensors["fc2.bias"]))
        y.backward()
        rows.append(torch.cat([y.detach(), xp.grad]))
    return torch.stack(rows).double()


def cpp_lines(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in argv], capture_output=True, text=True)


def test_socas_loading_path_in_cpp_prints_what_python_computes(soca_run, soca_files, tmp_path):
    require_compilers()
    program = build_cpp_consumer("soca_icenet")
    run_dir, data = soca_run
    x = soca_points(data)
    csv = write_points(tmp_path / "points.csv", ICENET_INPUTS, x)
    done = cpp_lines([program, soca_files, csv, "--hidden-size", HIDDEN])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split(",") == ["aice", *[f"daice_d{name}" for name in ICENET_INPUTS]]
    from_cpp = torch.tensor([[float(v) for v in line.split(",")] for line in lines[1:]], dtype=torch.float64)
    assert from_cpp.shape == (len(x), 8)
    model = best_model(run_dir)
    aice, jacobian = model.predict(x)[:, 0], model.jacobian(x)[:, 0, :]
    # Python's model normalises in float64, IceNet in float32: equal to float32 rounding
    aice_error = float((from_cpp[:, 0] - aice).abs().max())
    jacobian_error = float(((from_cpp[:, 1:] - jacobian).abs() / jacobian.abs().amax(dim=0)).max())
    assert aice_error < 2e-6 and jacobian_error < 1e-5, (aice_error, jacobian_error)  # 5.4e-7 and 1.7e-6 seen
    assert aice.std() > 0.05 and (from_cpp[:, 1:].abs().amax(dim=0) > 0).all()  # points that differ; no zero column
    # IceNet transcribed in Python (float32, the same operations, the same kernels): the same float32 numbers, bit
    # for bit (%.9g prints a float32 exactly)
    assert torch.equal(from_cpp.float(), icenet_in_python(soca_files, x).float())
    # ufs_emulator --format soca loads the files the same way: the same float32 values
    consumer = cpp_lines([build_cpp_consumer(), soca_files, csv, "--format", "soca"])
    assert consumer.returncode == 0, consumer.stderr
    rows = [[float(v) for v in line.split(",")] for line in consumer.stdout.strip().splitlines()[1:]]
    assert torch.equal(torch.tensor(rows, dtype=torch.float64).float(), from_cpp.float())
    # the statistics IceNet uses are the normalization file's (loadNorm after torch::load): other moments there, other
    # numbers, as the transcription computes them; float64 moments (what this export wrote before) fail in forward
    moved = tmp_path / "moved" / "arctic.pt"
    moved.parent.mkdir()
    shutil.copy(soca_files, moved)
    for dtype, shift in ((torch.float32, 0.5), (torch.float64, 0.0)):
        moments = [moment.to(dtype) for moment in read_tensor_vector(normalization_path(soca_files))]
        with quiet_torchscript():
            torch.jit.script(SocaMoments([moments[0] + shift, moments[1]])).save(str(normalization_path(moved)))
        done = cpp_lines([program, moved, csv, "--hidden-size", HIDDEN])
        if dtype == torch.float64:  # torch::load and loadNorm take them without a word; forward cannot mix them
            assert done.returncode == 2 and "double != float" in done.stderr, done.stderr
            continue
        shifted = torch.tensor([[float(v) for v in line.split(",")] for line in done.stdout.strip().splitlines()[1:]],
                               dtype=torch.float64)
        assert (shifted[:, 0] - from_cpp[:, 0]).abs().max() > 1e-3
        assert torch.equal(shifted.float(), icenet_in_python(moved, x).float())
    # bad input: one line, exit 2
    short = tmp_path / "short.csv"
    short.write_text("1,2,3\n")
    for argv, fragment in (
        ([program, soca_files, short, "--hidden-size", HIDDEN], "has 3 values; IceNet takes 7"),
        ([program, soca_files, csv], "usage: soca_icenet"),
        ([program, csv, csv, "--hidden-size", HIDDEN], "does not load as SOCA's BaseEmul loads IceNet"),
    ):
        refused = cpp_lines(argv)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert fragment in refused.stderr, refused.stderr


@pytest.mark.parametrize("activation", ["relu", "gelu", "identity"])
def test_ufsnet_layout_runs_in_cpp_with_its_activation(activation, tmp_path):
    """ufs_emulator --format ufsnet (UfsNet, ufs_net.h) computes the activation written in the file, as Python."""
    require_compilers()
    model = ufsnet_model(activation)
    out = tmp_path / "ufsnet" / "model.pt"
    write_ufsnet(model, UFSNET_META, {"optimizer": "adam"}, out)
    x = ufsnet_points(model)
    csv = write_points(tmp_path / "points.csv", DEFAULT_INPUTS, x)
    done = cpp_lines([build_cpp_consumer(), out, csv, "--format", "ufsnet"])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rows = torch.tensor([[float(v) for v in line.split(",")] for line in done.stdout.strip().splitlines()[1:]],
                        dtype=torch.float64)
    predictions, jacobian = model.predict(x), model.jacobian(x)
    assert float((rows[:, :1] - predictions).abs().max() / predictions.abs().max()) < 1e-6
    assert float(((rows[:, None, 1:] - jacobian).abs() / jacobian.abs().amax(dim=(0, 1), keepdim=True)).max()) < 1e-6
    assert predictions.std() > 1e-3
