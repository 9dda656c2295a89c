"""`python -m toolkit.export torchscript`: the TorchScript module that the UFS teams' C++ programs load.

torch 2.13 deprecates TorchScript (AOTInductor, `aoti`, is the path for new deployments), but aibalance's
ufs_emulator.cpp and SOCA's MLBalance load TorchScript archives. This module and toolkit.export.soca are the only
places that call torch.jit, and every call is inside `quiet_torchscript()`, which silences torch's own deprecation
warnings for these calls alone (by message; any other warning still shows).

aibalance's layout (guillaumevernieres/aibalance at b1eccbc, `--format aibalance`):
ufsemulator/export_to_torchscript.py scripts its UfsEmulatorFFNN (ufsemulator/model.py) with torch.jit.script and
saves it; the module holds

- `network`, an nn.Sequential Linear, GELU, ..., Linear (model.py:32-47): our UfsEmulator's `net`, the same indices
  (ReLU or no activation between the layers where the run trained so);
- buffers input_mean, input_std, output_mean, output_std (model.py:50-53), here float64 as in our model;
- attributes input_names, output_names (CF standard names), input_levels, output_levels and `meta`, as
  export_to_torchscript.py sets them: the levels are the vertical level each field was read at, the atmosphere's
  (aibalance's CF_ATM: tair, uatm, vatm, tsfc, qref; here also flwdn, fswdn, which aibalance maps nowhere) at nlevs
  - 1, the last level of the training's --data-atmos fields where they have a level dimension, else 127 (its
  default `atm_level_index`), every ocean/ice field at 0 (aibalance's `[:, :, 0]`); `meta` is a dict of strings
  with model_class, hidden_layers, hidden_size, input_variables, output_variables (CF names, comma-separated),
  input_short_names, output_short_names, optimizer and loss as its exporter writes them: optimizer
  `str(config["training"]["optimizer"])`, the Python text of the optimizer's settings dict ({'type': 'adam',
  'learning_rate': 0.0001, 'weight_decay': 0.0001}: ours from --optimizer, --lr, --weight-decay), loss
  `str(config["training"].get("loss", ""))`, which is "" (aibalance's configs name it loss_function); ours adds
  loss_function (mse), output_activation, input_units, output_units, recipe and checkpoint. The whole meta of the
  export (toolkit.export.load) is the extra file `meta.json` of the archive as well;
- methods (model.py:147-259) forward (normalised inputs -> normalised outputs: the network), normalize_input,
  denormalize_output, predict (physical -> physical), jac (d y_norm / d x_norm, [n, outputs, inputs]) and
  jac_physical (d y / d x in physical units). jac is autograd through forward(), one backward per output, as
  aibalance's and UfsEmulator.jacobian, but with torch.autograd.grad under enable_grad, so it works after
  serialisation (which aibalance's export doubts, export_to_torchscript.py:228-251) and under torch::NoGradGuard.
  Inputs may be float32 or float64; every output is float32, as aibalance's float32 module returns them (a C++
  caller reads them with data_ptr<float>()): computed as UfsEmulator computes them (normalisation in float64, the
  network in its own dtype) and rounded to float32 once, at the end, so each equals the model's value rounded.

aibalance's layout of its commit c710abb (`--format aibalance-c710abb`), as its ufsemulator/model.py and
ufs_emulator.cpp (`ufs_emulator MODEL INPUT_SIZE`: forward on a float32 [1, n], the Jacobian by backward through
forward) use it: `forward` takes PHYSICAL inputs (c710abb's forward normalises them itself: (x - input_mean) /
input_std, then the network) and returns physical outputs (c710abb trained on unnormalised targets; ours are
denormalised), float32; `jac` is d forward / d x, physical units, [n, outputs, inputs]; the same buffers and the same
predict and jac_physical as the HEAD layout, and the same metadata attributes (c710abb's module had none: extra
attributes are ignored by its program).

SOCA's layout (`--format soca`) is written by toolkit.export.soca.
"""

# No `from __future__ import annotations`: torch.jit.script reads the class annotations below as types.
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from toolkit.errors import UsageError

SUFFIXES = (".pt", ".ts")  # SOCA's files are .pt (test/Data/mlbalance/arctic.pt); aibalance's default is .ts

OCEAN_LEVEL = 0  # aibalance b1eccbc data.py: the ocean/ice fields read at [:, :, 0]; level_index 0
ATMOSPHERE_LEVEL = 127  # its atm_level_index default (data.py, export_to_torchscript.py): nlevs - 1 of 128 levels
LAYOUTS = ("aibalance", "aibalance-c710abb")  # the HEAD layout (forward normalised) and c710abb's (forward physical)


# torch's notice for each torch.jit call: "`torch.jit.script` is deprecated. Please switch to ...", and on Python
# 3.14+ "`torch.jit.script` is not supported in Python 3.14+ and may break. ..." (torch/jit/_script.py, 2.15)
JIT_DEPRECATED = r"`torch\.jit\.\w+` is (deprecated|not supported in Python 3\.\d+\+)"


@contextmanager
def quiet_torchscript() -> Iterator[None]:
    """Silence the deprecation warnings that torch raises for the TorchScript calls of this export
    (`torch.jit.script` is deprecated ..., `torch.jit.load` is deprecated ...), here only: a DeprecationWarning
    in torch 2.13, a FutureWarning (shown by default) in 2.15, the same message."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=JIT_DEPRECATED, category=category)
        yield


def cf_name(name: str) -> str:
    """aibalance's CF name for one of ours (toolkit.data.ufs_cf.AIBALANCE_CF, from its cf_mappings.py); a name that
    file does not know takes the first of toolkit.data.ufs.CF_NAMES."""
    from toolkit.data.ufs import CF_NAMES
    from toolkit.data.ufs_cf import AIBALANCE_CF

    return AIBALANCE_CF.get(name) or next(iter(CF_NAMES.get(name, ())), name)


def check_out(out: Path, what: str = "a TorchScript archive") -> Path:
    """--out as `aoti` takes it: a file name with the format's suffix, in a directory (made when missing); an
    existing file is replaced whole (written beside it, then renamed), a directory is refused."""
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulator.pt")
    if out.suffix not in SUFFIXES:
        hint = " (.pt2 is an AOTInductor package: python -m toolkit.export aoti)" if out.suffix == ".pt2" else ""
        raise UsageError(
            f"--out {out} does not end in {' or '.join(SUFFIXES)}; {what} is a .pt file, e.g. emulator.pt{hint}"
        )
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is a file, not a directory")
    return out


def write_whole(out: Path, save) -> None:
    """save(path) to a temporary file beside `out`, then rename it to `out`: the file appears whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.stem}.{os.getpid()}.partial{out.suffix}")
    try:
        save(partial)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)


def optimizer_settings(config: dict) -> str:
    """aibalance's meta["optimizer"]: str() of its config's training.optimizer dict (type, learning_rate,
    weight_decay, in its configs' order), from our flags."""
    settings = {"type": str(config.get("optimizer", "")), "learning_rate": config.get("lr"),
                "weight_decay": config.get("weight_decay")}
    return str({key: value for key, value in settings.items() if value is not None})


def field_level(name: str, atmosphere_level: int) -> int:
    """The vertical level aibalance's metadata gives a field: the atmosphere's (ufs_cf.CF_ATMOSPHERE) at
    `atmosphere_level` (nlevs - 1), every other (ocean/ice) at 0."""
    from toolkit.data.ufs_cf import CF_ATMOSPHERE

    return atmosphere_level if name in CF_ATMOSPHERE else OCEAN_LEVEL


def model_attributes(model: nn.Module, meta: dict, config: dict) -> dict:
    """aibalance's metadata (export_to_torchscript.py:144-186) for our model: names, levels and the meta dict. The
    atmosphere's level is meta["atmosphere_level"] where the export found it (atmosphere_level()), else 127."""
    inputs, outputs = list(meta["inputs"]), list(meta["outputs"])
    units = meta.get("units") or {}
    level = int(meta.get("atmosphere_level", ATMOSPHERE_LEVEL))
    linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
    described = {
        "model_class": "UfsEmulatorFFNN",
        "hidden_layers": str(len(linears) - 1),
        "hidden_size": str(linears[0].out_features),
        "input_variables": ",".join(cf_name(name) for name in inputs),
        "output_variables": ",".join(cf_name(name) for name in outputs),
        "input_short_names": ",".join(inputs),
        "output_short_names": ",".join(outputs),
        "optimizer": optimizer_settings(config),
        "loss": "",  # str(config["training"].get("loss", "")): aibalance's configs write loss_function, not loss
        "loss_function": "mse",  # recipes/ufs_emulator.py trains with MSE in normalised units
        "output_activation": output_activation(model),
        "input_units": ",".join(str(units.get(name, "")) for name in inputs),
        "output_units": ",".join(str(units.get(name, "")) for name in outputs),
        "recipe": str(meta["recipe"]),
        "checkpoint": str(meta["checkpoint"]),
    }
    return {
        "input_names": [cf_name(name) for name in inputs],
        "output_names": [cf_name(name) for name in outputs],
        "input_levels": [field_level(name, level) for name in inputs],
        "output_levels": [field_level(name, level) for name in outputs],
        "meta": described,
    }


def atmosphere_level(config: dict, data: dict) -> tuple[int, str]:
    """(nlevs - 1, where it came from) as aibalance's reader sets atm_level_index: the last level of the training's
    atmosphere field (tair, else another atmosphere input) in its --data-atmos file where that field has a trailing
    level dimension, else 127 (aibalance's default, for 2-D fields and for a file no longer there)."""
    from toolkit.data.ufs_cf import CF_ATMOSPHERE
    from toolkit.process import extras

    atmos = config.get("data_atmos")
    variables = data.get("variables") or {}
    names = [variables[name] for name in ("tair", *CF_ATMOSPHERE) if name in variables]
    if atmos and names and Path(atmos).expanduser().is_file():
        xr = extras.xarray()
        try:
            with xr.open_dataset(Path(atmos).expanduser(), engine="netcdf4", decode_times=False) as ds:
                stored = next((ds[name] for name in names if name in ds.variables), None)
                if stored is not None:
                    shape = list(stored.shape)
                    while len(shape) > 2 and shape[0] == 1:
                        shape = shape[1:]
                    if len(shape) == 3 and shape[2] > 0:
                        return shape[2] - 1, f"the last of {shape[2]} levels of {stored.name!r} in {atmos}"
        except (OSError, ValueError):  # unreadable now: aibalance's default, said in meta.json
            pass
    return ATMOSPHERE_LEVEL, f"aibalance's default atm_level_index ({ATMOSPHERE_LEVEL}): no level dimension read"


def output_activation(model: nn.Module) -> str:
    return str(getattr(model, "output_activation", "none"))  # models from before the option: none


class AibalanceEmulator(nn.Module):
    """aibalance's UfsEmulatorFFNN interface (ufsemulator/model.py:147-259) around a trained UfsEmulator, for
    torch.jit.script: the numbers of UfsEmulator.predict / .jacobian (normalised and physical), rounded to float32."""

    input_names: list[str]
    output_names: list[str]
    input_levels: list[int]
    output_levels: list[int]
    meta: dict[str, str]
    sigmoid_output: bool

    def __init__(self, model: nn.Module, attributes: dict):
        super().__init__()
        self.network = model.net  # aibalance's name (model.py:47); Linear/GELU at the same indices as ours
        for name in ("input_mean", "input_std", "output_mean", "output_std"):
            self.register_buffer(name, getattr(model, name).detach().clone())
        for parameter in self.network.parameters():  # an inference module: the closed-form jac needs no autograd
            parameter.requires_grad_(False)
        self.sigmoid_output = output_activation(model) == "sigmoid"
        self.input_names = list(attributes["input_names"])
        self.output_names = list(attributes["output_names"])
        self.input_levels = list(attributes["input_levels"])
        self.output_levels = list(attributes["output_levels"])
        self.meta = dict(attributes["meta"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised inputs -> normalised outputs (aibalance model.py:163-170; UfsEmulator.forward), float32."""
        return self.network_output(x).float()

    @torch.jit.export
    def network_output(self, z: torch.Tensor) -> torch.Tensor:
        """The network on normalised inputs, in its dtype (UfsEmulator.forward: with the sigmoid, its value
        normalised by the output statistics in float64)."""
        out = self.network(z)
        if self.sigmoid_output:
            return ((torch.sigmoid(out).double() - self.output_mean) / self.output_std).to(out.dtype)
        return out

    @torch.jit.export
    def normalize_input(self, x: torch.Tensor) -> torch.Tensor:
        """Physical -> normalised: (x - mean) / std in float64, returned in the network's dtype (float32)."""
        return ((x.double() - self.input_mean) / self.input_std).to(self.network[0].weight.dtype)

    @torch.jit.export
    def denormalize_output(self, y: torch.Tensor) -> torch.Tensor:
        """Normalised -> physical outputs: y * std + mean in float64, returned as float32."""
        return (y.double() * self.output_std + self.output_mean).float()

    @torch.jit.export
    def predict_double(self, x: torch.Tensor) -> torch.Tensor:
        """Physical inputs [n, inputs] -> physical outputs [n, outputs], float64 (UfsEmulator.predict)."""
        z = self.normalize_input(x)
        if self.sigmoid_output:
            return torch.sigmoid(self.network(z)).double()
        return self.network_output(z).double() * self.output_std + self.output_mean

    @torch.jit.export
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Physical inputs [n, inputs] -> physical outputs [n, outputs], float32: UfsEmulator.predict rounded."""
        return self.predict_double(x).float()

    @torch.jit.export
    def jac_double(self, x: torch.Tensor) -> torch.Tensor:
        """d y_norm / d x_norm at physical inputs x [n, inputs]: [n, outputs, inputs], float64. Autograd through the
        network as aibalance's jac (model.py:189-231) and UfsEmulator.jacobian compute it (one backward per output),
        with torch.autograd.grad and grad mode on for the call (set back after it), so it works after serialisation
        and under a caller's no_grad (torch::NoGradGuard in C++; not under InferenceMode)."""
        z = self.normalize_input(x).detach()  # before grad mode changes: a wrong shape raises here
        grad_was_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # TorchScript has no `with torch.enable_grad()`
        z.requires_grad_(True)
        y = self.network_output(z)
        gradients: list[Optional[torch.Tensor]] = []  # noqa: UP045 (TorchScript reads typing's Optional)
        for output in range(y.shape[1]):
            gradients.append(torch.autograd.grad([y[:, output].sum()], [z], retain_graph=True)[0])
        torch.set_grad_enabled(grad_was_enabled)
        rows: list[torch.Tensor] = []
        for gradient in gradients:
            assert gradient is not None
            rows.append(gradient)
        return torch.stack(rows, dim=1).double()

    @torch.jit.export
    def jac(self, x: torch.Tensor) -> torch.Tensor:
        """d y_norm / d x_norm at physical inputs x [n, inputs]: [n, outputs, inputs], float32 (jac_double)."""
        return self.jac_double(x).float()

    @torch.jit.export
    def jac_physical(self, x: torch.Tensor) -> torch.Tensor:
        """d y / d x in physical units, [n, outputs, inputs], float32 (aibalance model.py:233-259): the normalised
        Jacobian scaled by output_std / input_std in float64 (UfsEmulator.jacobian), then rounded."""
        scaled = self.jac_double(x) * self.output_std.view(1, -1, 1) / self.input_std.view(1, 1, -1)
        return scaled.float()


class C710abbEmulator(AibalanceEmulator):
    """aibalance c710abb's interface (ufsemulator/model.py at c710abb: forward normalises physical inputs itself;
    jac is d forward / d x): forward is physical -> physical and jac is physical, float32; the other methods as the
    HEAD layout's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Physical inputs [n, inputs] -> physical outputs [n, outputs], float32 (c710abb model.py:96-102): predict,
        differentiable in x (ufs_emulator.cpp at c710abb takes its Jacobian by backward through forward)."""
        return self.predict(x)

    @torch.jit.export
    def jac(self, x: torch.Tensor) -> torch.Tensor:
        """d forward / d x in physical units, [n, outputs, inputs], float32 (c710abb model.py:104-124)."""
        return self.jac_physical(x)


def check_layers(model: nn.Module) -> None:
    for layer in model.net:
        if not isinstance(layer, nn.Linear | nn.GELU | nn.ReLU | nn.Identity):
            raise UsageError(f"the TorchScript export knows Linear, GELU, ReLU and Identity layers, not "
                             f"{type(layer).__name__}")


def script_aibalance(model: nn.Module, attributes: dict, layout: str = "aibalance"):
    """The scripted module (aibalance's layout: HEAD's, or c710abb's) of a UfsEmulator."""
    check_layers(model)
    interface = C710abbEmulator if layout == "aibalance-c710abb" else AibalanceEmulator
    with quiet_torchscript():
        return torch.jit.script(interface(model, attributes))


def export_torchscript(run_dir: Path | str, out: Path | str, step: int | None = None,
                       layout: str = "aibalance") -> dict:
    """Write aibalance's TorchScript layout (`layout`: aibalance, HEAD's; aibalance-c710abb) of a run to `out`;
    returns the export's meta (also the archive's meta.json)."""
    from toolkit.export.load import load_run
    from toolkit.run.rundir import RunDir, read_json

    if layout not in LAYOUTS:
        raise UsageError(f"--format {layout!r}: give one of {', '.join(LAYOUTS)}")
    out = check_out(out)
    model, meta = load_run(run_dir, step)
    recorded = read_json(RunDir(Path(run_dir)).config) or {}
    level, source = atmosphere_level(recorded.get("config") or {}, recorded.get("data") or {})
    meta = {**meta, "atmosphere_level": level, "atmosphere_level_from": source}
    return write_torchscript(model, meta, run_config(run_dir), out, layout)


def run_config(run_dir: Path | str) -> dict:
    """config.json's "config" (load_run has read the file already)."""
    from toolkit.run.rundir import RunDir, read_json

    return (read_json(RunDir(Path(run_dir)).config) or {}).get("config") or {}


def write_torchscript(model: nn.Module, meta: dict, config: dict, out: Path, layout: str = "aibalance") -> dict:
    """aibalance's layout (HEAD's, or `layout` aibalance-c710abb) of a UfsEmulator `model` described by `meta`
    (load_run's) to `out`."""
    words = "c710abb's: forward physical" if layout == "aibalance-c710abb" else "HEAD's: forward normalised"
    meta = {**meta, "format": f"torchscript (aibalance's layout, {words})", "layout": layout,
            "output_activation": output_activation(model)}
    scripted = script_aibalance(model, model_attributes(model, meta, config), layout)
    with quiet_torchscript():
        write_whole(out, lambda path: scripted.save(str(path), _extra_files={"meta.json": json.dumps(meta)}))
    return meta


def load_torchscript(path: Path | str):
    """(the module, its meta.json) of an archive written by export_torchscript; torch's deprecation warning for
    torch.jit.load silenced here only."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UsageError(f"{path} {what}; give an archive written by python -m toolkit.export torchscript")
    extra = {"meta.json": ""}
    with quiet_torchscript():
        try:
            module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except Exception as error:  # not a zip, a zip that is not TorchScript, ...
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise UsageError(
                f"{path} is not a TorchScript archive ({type(error).__name__}: {first}); python -m "
                "toolkit.export torchscript RUN_DIR --out FILE.pt writes one"
            ) from None
    meta = json.loads(extra["meta.json"]) if extra["meta.json"] else {}
    return module, meta
