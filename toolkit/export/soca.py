"""`python -m toolkit.export torchscript RUN_DIR --out DIR/MODEL.pt --format soca`: SOCA's layout, two files.

SOCA's MLBalance (JCSDA-internal/soca, src/soca/MLBalance/KEmul/) builds its network in C++ and reads a trained one
with two calls (BaseEmul.h, constructor, "load model"): `torch::load(model_, modelFileName)`, then
`model_->loadNorm(modelFileName)` (IceNet.h loadNorm), which reads `<dir of MODEL>/normalization.<MODEL>` with
`torch::load(std::vector<torch::Tensor>&, ...)` and takes moments[0] as the input mean and moments[1] as the input
standard deviation (IceNet.h saveNorm writes {inputMean, inputStd}). So:

- MODEL.pt: what `torch::load(module, file)` reads: libtorch's InputArchive (torch/csrc/api/src/serialize/
  input-archive.cpp) loads the file as a TorchScript module and finds each parameter and buffer by name as an
  attribute of it (`module_.attr(key)`), each child module as a nested archive. IceNet.h registers its layers as
  `fc1`, `fc2` and its buffers `input_mean`, `input_std`; ours are `fc1` ... `fc<L+1>` (the Linear layers of our
  L x hidden GELU MLP, in order), `input_mean`, `input_std`, and also `output_mean`, `output_std` (our outputs are
  normalised too), all float64 statistics as in our model. String attributes `output_activation` ("none" or
  "sigmoid": IceNet.h's forward ends in a sigmoid) and `gelu_approximate` say the rest, and aibalance's metadata
  attributes (input_names, output_names, input_levels, output_levels, meta; toolkit.export.torchscript) name the
  inputs. Unknown attributes are ignored by torch::load. The archive holds no methods: as with IceNet, the C++
  network class computes (export/cpp/ufs_net.h, UfsNet: IceNet's interface for BaseEmul<Net>, our layers).
- normalization.MODEL.pt: what `torch::save(std::vector<torch::Tensor>)` writes and `torch::load` of a vector reads
  (torch/serialize.h: tensor i under the key "i", read while key "i" exists): [input_mean, input_std] in SOCA's
  order, then [output_mean, output_std] (which IceNet.h's loadNorm leaves unread), float64.

IceNet.h's own network (one hidden layer, no activation between, sigmoid output) cannot hold ours: SOCA builds the
network class it is given, and UfsNet is the one for these files.
"""

# No `from __future__ import annotations`: torch.jit.script reads the class annotations below as types.
from pathlib import Path

import torch
from torch import nn

from toolkit.errors import UsageError
from toolkit.export.torchscript import (
    check_layers,
    check_out,
    model_attributes,
    output_activation,
    quiet_torchscript,
    run_config,
    write_whole,
)

MOMENTS = ("input_mean", "input_std", "output_mean", "output_std")  # the order of normalization.<MODEL>


def normalization_path(model_path: Path | str) -> Path:
    """IceNet.h saveNorm/loadNorm: parent_path() + "/normalization." + filename()."""
    model_path = Path(model_path)
    return model_path.parent / f"normalization.{model_path.name}"


class SocaArchive(nn.Module):
    """The tensors (and attributes) that torch::load gives a SOCA network: no methods."""

    output_activation: str
    gelu_approximate: str
    input_names: list[str]
    output_names: list[str]
    input_levels: list[int]
    output_levels: list[int]
    meta: dict[str, str]

    def __init__(self, model: nn.Module, attributes: dict):
        super().__init__()
        linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
        for index, linear in enumerate(linears, start=1):
            self.add_module(f"fc{index}", linear)  # IceNet.h: register_module("fc1", ...), "fc2"
        for name in MOMENTS:
            self.register_buffer(name, getattr(model, name).detach().clone())  # IceNet.h: register_buffer
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        self.output_activation = output_activation(model)
        gelus = [layer.approximate for layer in model.net if isinstance(layer, nn.GELU)]
        self.gelu_approximate = gelus[0] if gelus else "none"
        for name, value in attributes.items():
            setattr(self, name, value)


class SocaMoments(nn.Module):
    """torch::save(std::vector<torch::Tensor>)'s archive: tensor i as the attribute "i"."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        for index, tensor in enumerate(tensors):
            self.register_buffer(str(index), tensor.detach().clone())


def export_soca(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write MODEL.pt and normalization.MODEL.pt (SOCA's layout) of a run; returns the export's meta."""
    from toolkit.export.load import load_run

    out = check_out(out, "SOCA's model file")
    if normalization_path(out).is_dir():
        raise UsageError(f"--out {out}: {normalization_path(out)}, where SOCA reads the normalisation, is a directory")
    model, meta = load_run(run_dir, step)
    return write_soca(model, meta, run_config(run_dir), out)


def write_soca(model: nn.Module, meta: dict, config: dict, out: Path) -> dict:
    """SOCA's layout of a UfsEmulator `model` described by `meta` (load_run's): `out` and its normalization file."""
    check_layers(model)
    norm = normalization_path(out)
    meta = {**meta, "format": "soca", "normalization": norm.name, "output_activation": output_activation(model)}
    with quiet_torchscript():
        archive = torch.jit.script(SocaArchive(model, model_attributes(model, meta, config)))
        moments = torch.jit.script(SocaMoments([getattr(model, name) for name in MOMENTS]))

        def both(path: Path) -> None:  # the model saved, then the normalization file written whole, then renamed
            archive.save(str(path))
            write_whole(norm, lambda norm_path: moments.save(str(norm_path)))

        write_whole(out, both)  # a failed save leaves both files as they were
    return meta


def _archive(path: Path, what: str):
    if not path.is_file():
        raise UsageError(f"{path} ({what}) {'is a directory' if path.is_dir() else 'does not exist'}")
    with quiet_torchscript():
        try:
            return torch.jit.load(str(path), map_location="cpu")._c
        except Exception as error:
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            kind = type(error).__name__
            raise UsageError(f"{path} ({what}) is not a TorchScript archive ({kind}: {first})") from None


def read_tensor_vector(path: Path | str) -> list[torch.Tensor]:
    """A file of torch::save(std::vector<torch::Tensor>) read as torch::load reads it (torch/serialize.h): the
    attribute "0", "1", ... while it exists and is a tensor."""
    archive = _archive(Path(path), "a saved vector of tensors")
    tensors: list[torch.Tensor] = []
    while archive.hasattr(str(len(tensors))) and isinstance(archive.getattr(str(len(tensors))), torch.Tensor):
        tensors.append(archive.getattr(str(len(tensors))))
    return tensors


def read_soca(model_path: Path | str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict]:
    """SOCA's two files read as the C++ reads them: (each tensor of MODEL.pt by its name, as torch::load(module)
    finds it, e.g. fc1.weight; the normalization file's tensors in order; the string attributes)."""
    model_path = Path(model_path)
    archive = _archive(model_path, "SOCA's model file")
    tensors: dict[str, torch.Tensor] = {}
    index = 1
    while archive.hasattr(f"fc{index}"):
        layer = archive.getattr(f"fc{index}")
        for name in ("weight", "bias"):
            tensors[f"fc{index}.{name}"] = layer.getattr(name)
        index += 1
    for name in MOMENTS:
        if archive.hasattr(name):
            tensors[name] = archive.getattr(name)
    attributes = {
        name: archive.getattr(name)
        for name in (
            "output_activation",
            "gelu_approximate",
            "input_names",
            "output_names",
            "input_levels",
            "output_levels",
            "meta",
        )
        if archive.hasattr(name)
    }
    return tensors, read_tensor_vector(normalization_path(model_path)), attributes


def soca_emulator(model_path: Path | str) -> nn.Module:
    """A UfsEmulator rebuilt from SOCA's two files (the statistics from the normalization file, as loadNorm takes
    them), in eval mode."""
    from toolkit.models.ufs_emulator import UfsEmulator

    tensors, moments, attributes = read_soca(model_path)
    if len(moments) != len(MOMENTS):
        raise UsageError(
            f"{normalization_path(model_path)} holds {len(moments)} tensors; SOCA's layout written "
            f"here holds {len(MOMENTS)} ({', '.join(MOMENTS)})"
        )
    weights = [tensor for name, tensor in tensors.items() if name.endswith(".weight")]  # fc1, fc2, ... in order
    if not weights:
        raise UsageError(
            f"{model_path} holds no layer fc1; export it with python -m toolkit.export torchscript --format soca"
        )
    extra = (
        {"output_activation": attributes["output_activation"]} if attributes.get("output_activation") != "none" else {}
    )
    model = UfsEmulator(*moments, hidden=weights[0].shape[0], layers=len(weights) - 1, **extra)
    linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        for index, linear in enumerate(linears, start=1):
            linear.weight.copy_(tensors[f"fc{index}.weight"])
            linear.bias.copy_(tensors[f"fc{index}.bias"])
    return model.eval()
