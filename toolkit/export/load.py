"""Export's first part: find a run's checkpoint (its best, or --step), rebuild its model from the registry of
exportable families, or load an exported package; every refusal is one line."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from toolkit.errors import UsageError
from toolkit.run import checkpoint
from toolkit.run.rundir import MODEL_FILE, RunDir, read_json


def _read_json(path: Path, what: str) -> dict:
    data = read_json(path)
    if data is None:
        raise UsageError(f"{path} is missing or unreadable ({what}); give a run directory written by a recipe "
                         "(runs/<recipe>/<run>)")
    return data


def best_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint to export: --step, else the best-validation step (summary.json, else the newest complete
    checkpoint's progress); refused when incomplete or damaged."""
    if step is None:
        summary_path = RunDir(run_dir).summary
        if summary_path.is_file():
            step = _read_json(summary_path, "the run's summary").get("best_step")
        else:
            newest = checkpoint.newest_complete(run_dir)
            if newest is None:
                raise UsageError(f"{run_dir} has no complete checkpoint to export; train first (or give a run dir)")
            damage = checkpoint.damage_of(newest)  # its progress.json, read next, may be the damaged file
            if damage:
                raise UsageError(f"{newest} is damaged ({damage}) and {run_dir} has no summary.json naming the best "
                                 "step; give --step N of an intact checkpoint")
            step = checkpoint.read_progress(newest).get("best_step") or checkpoint.step_of(newest)
    if step is None:
        raise UsageError(f"{run_dir}/summary.json names no best step; give --step N")
    found = checkpoint.checkpoints_root(run_dir) / f"step_{int(step)}"
    if not checkpoint.is_complete(found):
        raise UsageError(f"{found} is not a complete checkpoint; give --step N of one under {found.parent}")
    damage = checkpoint.damage_of(found)
    if damage:
        raise UsageError(f"{found} is damaged ({damage}); give --step N of an intact checkpoint")
    return found


def load_run(run_dir: Path | str, step: int | None = None) -> tuple[torch.nn.Module, dict]:
    """The run's model at its best (or --step) checkpoint, in eval mode, and what describes it: recipe, checkpoint,
    input and output names, units, and the domain selection of its training."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a directory; give a run directory (runs/<recipe>/<run>)")
    info = _read_json(RunDir(run_dir).config, "the run's settings")
    recipe = info.get("recipe")
    if recipe not in EXPORTABLE:
        raise UsageError(f"{run_dir} is a run of {recipe!r}; export supports {', '.join(EXPORTABLE)}")
    found = best_checkpoint(run_dir, step)
    family = EXPORTABLE[recipe]
    config, data = info["config"], info.get("data") or {}
    model = family.build(config, load_file(str(found / MODEL_FILE))).eval()
    meta = {"recipe": recipe, "run_dir": str(run_dir), "checkpoint": found.name, **family.describe(config, data)}
    return model, meta


def _ufs_emulator(config: dict, weights: dict) -> torch.nn.Module:
    from toolkit.models.ufs_emulator import from_run_config

    model = from_run_config(config)
    model.load_state_dict(weights)
    return model


def _named(resolved: str | None, given: str | None, default: str) -> str:
    if resolved is not None:
        return resolved
    return default if given in (None, "auto") else given


def zeroed_inputs(data: dict) -> list[str]:
    """The inputs the run trained on as 0 (its domain's reader reads none of them: aibalance b1eccbc's), as its data
    fingerprint records them ("/zeroed=sice,uocn,..."); [] for a run that read them all (every run made before)."""
    fingerprint = str(data.get("fingerprint") or "")
    if "/zeroed=" not in fingerprint:
        return []
    return fingerprint.split("/zeroed=", 1)[1].split("/", 1)[0].split(",")


def _ufs_emulator_meta(config: dict, data: dict) -> dict:
    return {
        "inputs": list(config["inputs"]),
        "outputs": list(config["outputs"]),
        "units": data.get("units") or {},
        "variables": data.get("variables") or {},  # our name -> the name in the training's file, when it differed
        "zeroed": zeroed_inputs(data),  # inputs given as 0, as the training had them (predict gives them so too)
        "domain": {
            # the names the training resolved ("auto": tried in order), else the flags as given
            "mask_variable": _named(data.get("mask_variable"), config.get("mask_variable"), "tmask"),
            "lat_variable": _named(data.get("lat_variable"), config.get("lat_variable"), "TLAT"),
            "min_abs_lat": float(config.get("min_abs_lat", 0.0)),
            "hemisphere": config.get("hemisphere", "both"),
        },
        "signature": "x [n, inputs] float64 -> (predictions [n, outputs], jacobian [n, outputs, inputs]) float64, "
        "physical units",
        "config": dict(config),  # every flag, so that predict --model selects the training's domain as a run does
    }


@dataclass(frozen=True)
class Exportable:
    """A family that export knows: how to rebuild its model from config.json's "config" and the checkpoint's weights,
    and what describes it to a user of the export (from "config" and config.json's "data"), e.g. its inputs and
    outputs. A second family joins EXPORTABLE with its own two functions."""

    build: Callable[[dict, dict], torch.nn.Module]
    describe: Callable[[dict, dict], dict]


EXPORTABLE: dict[str, Exportable] = {"ufs_emulator": Exportable(_ufs_emulator, _ufs_emulator_meta)}



@contextmanager
def quiet_torch_internals():
    """Silence two warnings that torch 2.13 raises from its OWN code while compiling, so users see none: importing
    inductor imports torch.utils.mkldnn, whose module-level classes use `torch.jit.script_method` (a
    DeprecationWarning per class; our export calls no torch.jit API), and inductor's debug wrapper deep-copies an
    FX graph whose pytree LeafSpec warns about its own deprecated isinstance check (a FutureWarning). Narrow
    filters, by message: any other warning still shows."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):  # a FutureWarning in torch 2.15
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=category)
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        yield


def load_package(path: Path | str):
    """(the compiled program, its meta) from a package written by export_aoti; the program maps x [n, inputs]
    float64 to (predictions, jacobian)."""
    from toolkit.process.torch_floor import AOTI, require_torch

    require_torch(AOTI, "an AOTInductor package (--model .pt2)",
                  "pip install 'torch>=2.6', or predict from the run directory (predict RUN_DIR ...)")
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UsageError(f"--model {path} {what}; give a package written by python -m toolkit.export aoti (.pt2)")
    with quiet_torch_internals():
        import torch._inductor

        try:
            program = torch._inductor.aoti_load_package(str(path))
            metadata = program.get_metadata()
        except Exception as error:  # a zip that is not a package, not a zip at all, ...: torch raises many kinds
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise UsageError(
                f"--model {path} is not an AOTInductor package ({type(error).__name__}: {first}); "
                "python -m toolkit.export aoti RUN_DIR --out FILE.pt2 writes one"
            ) from None
    if "meta.json" not in metadata:
        raise UsageError(
            f"--model {path} holds no meta.json in its metadata; export it with python -m toolkit.export aoti"
        )
    return program, json.loads(metadata["meta.json"])
