"""`python -m toolkit.export torchscript RUN_DIR --out DIR/MODEL.pt --format soca`: the two files that SOCA's C++
loads unchanged, and the layout of our general MLP for export/cpp/ufs_net.h.

SOCA's MLBalance (JCSDA soca, MLBalance/MLJac.h, which includes IceNet.h; the same classes as
guillaumevernieres/daml src/daml/IceEmul/IceNet.h and src/daml/Base/BaseEmul.h) builds `IceNet(inputSize,
hiddenSize, outputSize)` from its YAML and reads a trained one with two calls (BaseEmul.h, "load model"):
`torch::load(model_, modelFileName)`, then `model_->loadNorm(modelFileName)`, which reads `<dir of
MODEL>/normalization.<MODEL>` with `torch::load(std::vector<torch::Tensor>&, ...)` and takes moments[0] as the input
mean and moments[1] as the input standard deviation (IceNet.h saveNorm writes {inputMean, inputStd}). IceNet's
forward is `sigmoid(fc2(fc1((x - inputMean) / inputStd)))`, all float32 (its buffers are `torch::full(..., 0.0)`,
float32; its jac reads the point with `torch::from_blob(x.data_ptr(), {x.size(0)}, torch::requires_grad())`,
float32), and MLJac.h fills x as tair, tsfc, sst, sss, hs, hi, sice (ICENET_INPUTS) and reads Jacobian entries 2-5
as d/dsst, d/dsss, d/dhs, d/dhi. So `--format soca` (write_soca) writes

- MODEL.pt: what `torch::load(module, file)` reads: libtorch's InputArchive loads the file as a TorchScript module
  and finds each parameter and buffer by name as an attribute of it, each child module as a nested archive: the
  child modules `fc1`, `fc2` (weight, bias) and the buffers `input_mean`, `input_std`, float32, nothing else that
  torch::load reads (the export's meta is the archive's extra file meta.json, which torch::load never opens);
- normalization.MODEL.pt: what `torch::save(std::vector<torch::Tensor>)` writes and `torch::load` of a vector reads
  (torch/serialize.h: tensor i under the key "i", read while key "i" exists): exactly [input mean, input std],
  float32, in SOCA's input order.

Only a model that IceNet is can be written so: the recipe's `--preset soca` (--architecture icenet: one hidden
layer, no activation between the layers, a sigmoid output, no output statistics) on ICENET_INPUTS in that order, to
aice. Anything else is refused in one line saying what SOCA expects: IceNet.h compiled as published would load
another network's file without a word (torch::load reads fc1 and fc2 by name, set_ adopts their shapes and dtype)
and compute something else, or fail only in forward (float64 statistics against float32 weights).

`--format ufsnet` (write_ufsnet) is the layout of our general MLP, for a network class that SOCA would have to adopt
(export/cpp/ufs_net.h, UfsNet: IceNet's interface, our layers): MODEL.pt with `fc1` ... `fc<L+1>` (the Linear layers
of the L x hidden MLP, in order), the float64 buffers `input_mean`, `input_std`, `output_mean`, `output_std`, the
string attributes `activation` (between the layers: "gelu", "relu" or "identity"), `output_activation` ("none" or
"sigmoid") and `gelu_approximate`, and aibalance's metadata attributes (input_names, output_names, input_levels,
output_levels, meta; toolkit.export.torchscript); normalization.MODEL.pt holds [input mean, input std, output mean,
output std], float64.
"""

# No `from __future__ import annotations`: torch.jit.script reads the class annotations below as types.
import json
from pathlib import Path

import torch
from torch import nn

from toolkit.errors import UsageError
from toolkit.export.torchscript import (
    check_out,
    model_attributes,
    output_activation,
    quiet_torchscript,
    run_config,
    write_whole,
)
from toolkit.models.ufs_emulator import ICENET_INPUTS, is_icenet

MOMENTS = ("input_mean", "input_std", "output_mean", "output_std")  # the order of ufsnet's normalization.<MODEL>
ICENET_MOMENTS = ("input_mean", "input_std")  # IceNet.h saveNorm: {inputMean, inputStd}; loadNorm reads these two
ICENET_TENSORS = ("input_mean", "input_std", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")  # torch::load reads
ICENET_OUTPUTS = ("aice",)
# What --format soca writes, in the words of the refusal
SOCA_EXPECTS = (
    "SOCA's C++ (MLJac.h, IceNet.h) runs IceNet: sigmoid(fc2(fc1((x - input_mean) / input_std))), one hidden layer, "
    f"no activation between, no output statistics, float32, on its 7 inputs in this order: {' '.join(ICENET_INPUTS)} "
    "-> aice"
)


def normalization_path(model_path: Path | str) -> Path:
    """IceNet.h saveNorm/loadNorm: parent_path() + "/normalization." + filename()."""
    model_path = Path(model_path)
    return model_path.parent / f"normalization.{model_path.name}"


def check_normalization_place(out: Path) -> None:
    if normalization_path(out).is_dir():
        raise UsageError(f"--out {out}: {normalization_path(out)}, where SOCA reads the normalisation, is a directory")


# ---- SOCA's layout: IceNet ----------------------------------------------------------------------------------------


def soca_mismatches(model: nn.Module, meta: dict) -> list[str]:
    """What keeps SOCA's IceNet from running this model as it was trained (empty when nothing does)."""
    problems = []
    if not is_icenet(model):
        linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
        between = sorted({type(layer).__name__ for layer in model.net if not isinstance(layer, nn.Linear)})
        network = (f"{len(linears) - 1} hidden layer(s) of {linears[0].out_features} with "
                   f"{', '.join(between) or 'nothing'} between, output activation {output_activation(model)}")
        if not (bool((model.output_mean == 0).all()) and bool((model.output_std == 1).all())):
            network += ", outputs normalised by their statistics"
        problems.append(f"the network: {network}")
    if tuple(meta["inputs"]) != ICENET_INPUTS:
        problems.append(f"the inputs {' '.join(meta['inputs'])}")
    if tuple(meta["outputs"]) != ICENET_OUTPUTS:
        problems.append(f"the outputs {' '.join(meta['outputs'])}")
    return problems


def check_soca(model: nn.Module, meta: dict) -> None:
    """One line when SOCA cannot run the model: what SOCA expects, what the run has, what to do."""
    problems = soca_mismatches(model, meta)
    if problems:
        where = meta.get("run_dir") or "the model"
        raise UsageError(f"--format soca: {SOCA_EXPECTS}; {where} has {'; '.join(problems)}. Train it with "
                         "python recipes/ufs_emulator.py --preset soca, or write our MLP with --format ufsnet "
                         "(export/cpp/ufs_net.h)")


class IceNetArchive(nn.Module):
    """What `torch::load` gives IceNet (IceNet.h): register_module("fc1"), ("fc2"), register_buffer("input_mean"),
    ("input_std"); float32. No methods: IceNet's C++ class computes."""

    def __init__(self, model: nn.Module):
        super().__init__()
        first, second = [layer for layer in model.net if isinstance(layer, nn.Linear)]
        self.register_buffer("input_mean", model.input_mean.detach().float().clone())
        self.register_buffer("input_std", model.input_std.detach().float().clone())
        self.fc1 = nn.Linear(first.in_features, first.out_features, dtype=torch.float32)
        self.fc2 = nn.Linear(second.in_features, second.out_features, dtype=torch.float32)
        with torch.no_grad():
            for mine, trained in ((self.fc1, first), (self.fc2, second)):
                mine.weight.copy_(trained.weight.detach().float())
                mine.bias.copy_(trained.bias.detach().float())
        for parameter in self.parameters():
            parameter.requires_grad_(False)


class SocaMoments(nn.Module):
    """torch::save(std::vector<torch::Tensor>)'s archive: tensor i as the attribute "i"."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        for index, tensor in enumerate(tensors):
            self.register_buffer(str(index), tensor.detach().clone())


def export_soca(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write MODEL.pt and normalization.MODEL.pt as SOCA's IceNet loads them, of a run trained with --preset soca;
    returns the export's meta. Any other run is refused in one line before anything is written."""
    from toolkit.export.load import load_run

    out = check_out(out, "SOCA's model file")
    check_normalization_place(out)
    model, meta = load_run(run_dir, step)
    return write_soca(model, meta, run_config(run_dir), out)


def write_soca(model: nn.Module, meta: dict, config: dict, out: Path) -> dict:
    """SOCA's layout (IceNet.h) of an IceNet-shaped UfsEmulator `model` described by `meta` (load_run's): `out` and
    its normalization file. `config` is the run's (unused by IceNet's files; kept for the writers' one signature)."""
    check_soca(model, meta)
    norm = normalization_path(out)
    meta = {**meta, "format": "soca", "network": "IceNet (IceNet.h)", "normalization": norm.name,
            "moments": list(ICENET_MOMENTS), "dtype": "float32"}
    with quiet_torchscript():
        archive = torch.jit.script(IceNetArchive(model))
        moments = torch.jit.script(SocaMoments([getattr(archive, name) for name in ICENET_MOMENTS]))

        def both(path: Path) -> None:  # the model saved, then the normalization file written whole, then renamed
            archive.save(str(path), _extra_files={"meta.json": json.dumps(meta)})
            write_whole(norm, lambda norm_path: moments.save(str(norm_path)))

        write_whole(out, both)  # a failed save leaves both files as they were
    return meta


def _archive(path: Path, what: str, extra: dict | None = None):
    if not path.is_file():
        raise UsageError(f"{path} ({what}) {'is a directory' if path.is_dir() else 'does not exist'}")
    with quiet_torchscript():
        try:
            return torch.jit.load(str(path), map_location="cpu", _extra_files=extra if extra is not None else {})._c
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


def _tensor(archive, key: str):
    """`key` ("fc1.weight", "input_mean") looked up as torch::load looks it up: child archives, then the attribute;
    None when absent."""
    *children, name = key.split(".")
    for child in children:
        if not archive.hasattr(child):
            return None
        archive = archive.getattr(child)
    value = archive.getattr(name) if archive.hasattr(name) else None
    return value if isinstance(value, torch.Tensor) else None


def read_soca(model_path: Path | str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict]:
    """SOCA's two files read as IceNet reads them: (the tensors torch::load(IceNet) reads, by name; the
    normalization file's tensors in order, as loadNorm's torch::load reads them; the archive's meta.json). A tensor
    torch::load would miss is one line."""
    model_path = Path(model_path)
    extra = {"meta.json": ""}
    archive = _archive(model_path, "SOCA's model file", extra)
    tensors = {key: _tensor(archive, key) for key in ICENET_TENSORS}
    missing = [key for key, value in tensors.items() if value is None]
    if missing:
        raise UsageError(f"{model_path} lacks {', '.join(missing)}, which torch::load(IceNet) reads; export it with "
                         "python -m toolkit.export torchscript RUN_DIR --format soca")
    meta = json.loads(extra["meta.json"]) if extra["meta.json"] else {}
    return tensors, read_tensor_vector(normalization_path(model_path)), meta


def soca_emulator(model_path: Path | str) -> nn.Module:
    """A UfsEmulator rebuilt from SOCA's two files as IceNet holds them (the statistics from the normalization file,
    as loadNorm takes them; float32 values in the model's float64 buffers), in eval mode."""
    from toolkit.models.ufs_emulator import UfsEmulator

    tensors, moments, _ = read_soca(model_path)
    if len(moments) != len(ICENET_MOMENTS):
        raise UsageError(f"{normalization_path(model_path)} holds {len(moments)} tensors; IceNet's loadNorm reads "
                         f"{len(ICENET_MOMENTS)} ({', '.join(ICENET_MOMENTS)})")
    outputs = tensors["fc2.weight"].shape[0]
    model = UfsEmulator(moments[0].double(), moments[1].double(), torch.zeros(outputs, dtype=torch.float64),
                        torch.ones(outputs, dtype=torch.float64), hidden=tensors["fc1.weight"].shape[0], layers=1,
                        output_activation="sigmoid", activation="identity")
    first, second = [layer for layer in model.net if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        for layer, name in ((first, "fc1"), (second, "fc2")):
            layer.weight.copy_(tensors[f"{name}.weight"])
            layer.bias.copy_(tensors[f"{name}.bias"])
    return model.eval()


# ---- our general MLP's layout, for export/cpp/ufs_net.h (UfsNet) -------------------------------------------------


class UfsNetArchive(nn.Module):
    """The tensors (and attributes) that torch::load gives UfsNet (export/cpp/ufs_net.h): no methods."""

    activation: str
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
            self.add_module(f"fc{index}", linear)  # IceNet.h's names: register_module("fc1", ...), "fc2"
        for name in MOMENTS:
            self.register_buffer(name, getattr(model, name).detach().clone())
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        self.activation = str(getattr(model, "activation", "gelu"))
        self.output_activation = output_activation(model)
        gelus = [layer.approximate for layer in model.net if isinstance(layer, nn.GELU)]
        self.gelu_approximate = gelus[0] if gelus else "none"
        for name, value in attributes.items():
            setattr(self, name, value)


def export_ufsnet(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write MODEL.pt and normalization.MODEL.pt in UfsNet's layout (our MLP) of a run; returns the export's meta."""
    from toolkit.export.load import load_run

    out = check_out(out, "UfsNet's model file")
    check_normalization_place(out)
    model, meta = load_run(run_dir, step)
    return write_ufsnet(model, meta, run_config(run_dir), out)


def write_ufsnet(model: nn.Module, meta: dict, config: dict, out: Path) -> dict:
    """UfsNet's layout of a UfsEmulator `model` described by `meta` (load_run's): `out` and its normalization file."""
    for layer in model.net:  # what UfsNet computes between its layers
        if not isinstance(layer, nn.Linear | nn.GELU | nn.ReLU | nn.Identity):
            raise UsageError(f"--format ufsnet: UfsNet knows Linear layers with GELU, ReLU or nothing between, not "
                             f"{type(layer).__name__}")
    norm = normalization_path(out)
    meta = {**meta, "format": "ufsnet", "normalization": norm.name, "output_activation": output_activation(model)}
    with quiet_torchscript():
        archive = torch.jit.script(UfsNetArchive(model, model_attributes(model, meta, config)))
        moments = torch.jit.script(SocaMoments([getattr(model, name) for name in MOMENTS]))

        def both(path: Path) -> None:
            archive.save(str(path))
            write_whole(norm, lambda norm_path: moments.save(str(norm_path)))

        write_whole(out, both)
    return meta


def read_ufsnet(model_path: Path | str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict]:
    """UfsNet's two files read as the C++ reads them: (each tensor of MODEL.pt by its name, as torch::load(module)
    finds it, e.g. fc1.weight; the normalization file's tensors in order; the string attributes)."""
    model_path = Path(model_path)
    archive = _archive(model_path, "UfsNet's model file")
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
            "activation",
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


def ufsnet_emulator(model_path: Path | str) -> nn.Module:
    """A UfsEmulator rebuilt from UfsNet's two files (the statistics from the normalization file, as loadNorm takes
    them), in eval mode."""
    from toolkit.models.ufs_emulator import UfsEmulator

    tensors, moments, attributes = read_ufsnet(model_path)
    if len(moments) != len(MOMENTS):
        raise UsageError(
            f"{normalization_path(model_path)} holds {len(moments)} tensors; UfsNet's layout holds {len(MOMENTS)} "
            f"({', '.join(MOMENTS)})"
        )
    weights = [tensor for name, tensor in tensors.items() if name.endswith(".weight")]  # fc1, fc2, ... in order
    if not weights:
        raise UsageError(
            f"{model_path} holds no layer fc1; export it with python -m toolkit.export torchscript --format ufsnet"
        )
    model = UfsEmulator(*moments, hidden=weights[0].shape[0], layers=len(weights) - 1,
                        output_activation=attributes.get("output_activation", "none"),
                        activation=attributes.get("activation", "gelu"))
    linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
    with torch.no_grad():
        for index, linear in enumerate(linears, start=1):
            linear.weight.copy_(tensors[f"fc{index}.weight"])
            linear.bias.copy_(tensors[f"fc{index}.bias"])
    return model.eval()
