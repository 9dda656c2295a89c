"""Export a trained run for use outside Python, and run it on a netCDF file.

    python -m toolkit.export aoti RUN_DIR --out emulator.pt2 [--step N]
    python -m toolkit.export predict RUN_DIR --data IN.nc --out OUT.nc [--step N]
    python -m toolkit.export predict --model emulator.pt2 --data IN.nc --out OUT.nc

Both load the run's config.json and the weights of its best-validation checkpoint (summary.json's best_step; for a
run that has not finished, the best step recorded in its newest complete checkpoint; --step N picks another
complete checkpoint) and rebuild the model.

`aoti` writes an AOTInductor package (torch.export + torch._inductor.aoti_compile_and_package, the C++ deployment
path of torch 2.13, which deprecates TorchScript): a compiled program that takes PHYSICAL inputs x [n, inputs]
(float64, any n) and returns (predictions [n, outputs], Jacobian d outputs / d inputs [n, outputs, inputs]), both
float64 in physical units (the normalisation statistics are buffers of the model; the Jacobian is the closed form
UfsEmulator.predict_with_jacobian). The package's metadata holds `inputs` and `outputs` (comma-separated names) and
`meta.json` (names, units, checkpoint, how the training selected its domain). C++ loads it with
torch::inductor::AOTIModelPackageLoader (export/cpp/), Python with torch._inductor.aoti_load_package.

`predict` runs the model (a run's, or --model an exported package) on every cell of IN.nc's sea-ice domain,
selected as the training selected it (toolkit.data.ufs.select_patterns with the run's mask variable, latitude
variable, latitude bound and hemisphere; no thinning, no cap; open water stays in: aice is what is emulated; each
input under the name the training's file had for it, else ours), and writes OUT.nc on IN.nc's grid: each output
(e.g. `aice`), its Jacobian as one variable per input named d<output>_d<input> (e.g. `daice_dsst`, units aice's
per sst's), longitude and latitude, and `domain_mask`; fill values (1e30, as CICE writes) outside the domain; CF
attributes (long_name, units, _FillValue, coordinates). The file is written whole or not at all (temporary file,
rename).

Supported recipes: ufs_emulator. Bad input (a path, a run, a package, a missing variable, units that differ from the
training's, NaN inside the domain) is one line, exit 2, before anything is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from toolkit import checkpoint, extras
from toolkit.entry import one_line_errors
from toolkit.errors import UsageError
from toolkit.rundir import MODEL_FILE, RunDir

FILL_VALUE = 1.0e30  # CICE's spval: what its history files hold outside the ocean
PREDICT_CHUNK = 16384  # points per call: bounds the [chunk, width, inputs] Jacobian chain in memory


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(
            f"{path} is missing or unreadable ({what}; {type(error).__name__}); give a run directory "
            "written by a recipe (runs/<recipe>/<run>)"
        ) from None


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


def _ufs_emulator(config: dict, weights: dict) -> torch.nn.Module:
    from toolkit.models.ufs_emulator import from_run_config

    model = from_run_config(config)
    model.load_state_dict(weights)
    return model.eval()


EXPORTABLE = {"ufs_emulator": _ufs_emulator}


def _named(resolved: str | None, given: str | None, default: str) -> str:
    if resolved is not None:
        return resolved
    return default if given in (None, "auto") else given


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
    config, data = info["config"], info.get("data") or {}
    model = EXPORTABLE[recipe](config, load_file(str(found / MODEL_FILE)))
    meta = {
        "recipe": recipe,
        "run_dir": str(run_dir),
        "checkpoint": found.name,
        "inputs": list(config["inputs"]),
        "outputs": list(config["outputs"]),
        "units": data.get("units") or {},
        "variables": data.get("variables") or {},  # our name -> the name in the training's file, when it differed
        "domain": {
            # the names the training resolved ("auto": tried in order), else the flags as given
            "mask_variable": _named(data.get("mask_variable"), config.get("mask_variable"), "tmask"),
            "lat_variable": _named(data.get("lat_variable"), config.get("lat_variable"), "TLAT"),
            "min_abs_lat": float(config.get("min_abs_lat", 0.0)),
            "hemisphere": config.get("hemisphere", "both"),
        },
        "signature": "x [n, inputs] float64 -> (predictions [n, outputs], jacobian [n, outputs, inputs]) float64, "
        "physical units",
    }
    return model, meta


@contextmanager
def _quiet_torch_internals():
    """Silence two warnings that torch 2.13 raises from its OWN code while compiling, so users see none: importing
    inductor imports torch.utils.mkldnn, whose module-level classes use `torch.jit.script_method` (a
    DeprecationWarning per class; our export calls no torch.jit API), and inductor's debug wrapper deep-copies an
    FX graph whose pytree LeafSpec warns about its own deprecated isinstance check (a FutureWarning). Narrow
    filters, by message: any other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
        )
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        yield


def export_aoti(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write the AOTInductor package (.pt2); returns its meta (also in the package's metadata)."""
    from toolkit.models.ufs_emulator import ExportedEmulator

    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulator.pt2")
    if out.suffix != ".pt2":
        raise UsageError(f"--out {out} does not end in .pt2; AOTInductor packages are .pt2 files, e.g. emulator.pt2")
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is a file, not a directory")
    compiler = os.environ.get("CXX", "g++")  # what inductor compiles the package's C++ with
    if shutil.which(compiler) is None:
        raise UsageError(
            f"AOTInductor compiles C++ at export time and the compiler {compiler!r} (CXX, else g++) is not "
            "installed here: apt-get install g++ (make cpp-tools), or set CXX to one"
        )
    model, meta = load_run(run_dir, step)
    exported_module = ExportedEmulator(model)
    # Two example points (torch.export specialises a dimension of size 1); `points` is symbolic: any n >= 1.
    example = model.input_mean.unsqueeze(0).repeat(2, 1)
    with _quiet_torch_internals():
        import torch._inductor

        program = torch.export.export(
            exported_module, (example,), dynamic_shapes={"x": {0: torch.export.Dim("points", min=1)}}
        )
        metadata = {
            "inputs": ",".join(meta["inputs"]),
            "outputs": ",".join(meta["outputs"]),
            "meta.json": json.dumps(meta),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.stem}.{os.getpid()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(partial), inductor_configs={"aot_inductor.metadata": metadata}
            )
            partial.replace(out)
        finally:
            partial.unlink(missing_ok=True)
    return meta


def load_package(path: Path | str):
    """(the compiled program, its meta) from a package written by export_aoti; the program maps x [n, inputs]
    float64 to (predictions, jacobian)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UsageError(f"--model {path} {what}; give a package written by python -m toolkit.export aoti (.pt2)")
    with _quiet_torch_internals():
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


def _units_per(output_units: str, input_units: str) -> str:
    """d output / d input's units in udunits syntax, e.g. 1/K, 1/(m/s), 1/(W/m^2)."""
    if not input_units:
        return output_units
    below = input_units if re.fullmatch(r"[A-Za-z0-9_^]+", input_units) else f"({input_units})"
    return f"{output_units or '1'}/{below}"


def predict_netcdf(
    data: Path | str,
    out: Path | str,
    *,
    run_dir: Path | str | None = None,
    model_path: Path | str | None = None,
    step: int | None = None,
    lon_variable: str | None = None,
) -> dict:
    """Predictions and Jacobian on every domain cell of `data`, written to `out` on its grid (see the module's
    docstring); returns a summary (cells, model, out)."""
    xr = extras.xarray()
    from toolkit.data.ufs import grid_field, open_dataset, read_shard, require_variables, select_patterns

    data, out = Path(data).expanduser(), Path(out).expanduser()
    if run_dir is not None and model_path is not None:
        raise UsageError(f"RUN_DIR {run_dir} and --model {model_path}: give one of them, not both")
    if run_dir is None and model_path is None:
        raise UsageError("give RUN_DIR (a trained run) or --model FILE.pt2 (an exported package) to predict with")
    if model_path is not None and step is not None:
        raise UsageError("--step picks a checkpoint of RUN_DIR; an exported --model has one already")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulated.nc")
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is a file, not a directory")
    if data.exists() and out.exists() and out.resolve() == data.resolve():
        raise UsageError(f"--out {out} is the --data file; give another file name")
    if model_path is not None:
        program, meta = load_package(model_path)
        source = f"{model_path} (exported from {meta.get('run_dir')} {meta.get('checkpoint')})"

        def run(x):
            predictions, jacobian = program(x)
            return predictions, jacobian
    else:
        from toolkit.models.ufs_emulator import ExportedEmulator

        model, meta = load_run(run_dir, step)
        source = f"{run_dir} {meta['checkpoint']}"
        run = ExportedEmulator(model)
    inputs, outputs, units, domain = meta["inputs"], meta["outputs"], meta.get("units") or {}, meta.get("domain", {})
    mask_variable, lat_variable = domain.get("mask_variable", "tmask"), domain.get("lat_variable") or "TLAT"
    min_abs_lat, hemisphere = float(domain.get("min_abs_lat", 0.0)), domain.get("hemisphere", "both")
    # Open water (a run trained with it left out) stays in: aice is what is emulated, not an input to select by.
    where = {
        "both": f"|{lat_variable}| >= {min_abs_lat:g}",
        "north": f"{lat_variable} >= {min_abs_lat:g}",
        "south": f"{lat_variable} <= {-min_abs_lat:g}",
    }.get(hemisphere, hemisphere)
    where = f"{mask_variable} > 0.5 and {where}" if mask_variable else where

    with open_dataset(data) as ds:
        # each input under the name the training's file had for it (CICE history names), else under ours
        renamed = meta.get("variables") or {}
        fields = [renamed[n] if renamed.get(n) in ds.variables else n for n in inputs]
        require_variables(ds, data, fields, "input")
        for name, field in zip(inputs, fields, strict=True):
            have, trained = str(ds[field].attrs.get("units", "")), units.get(name, "")
            if have and trained and have != trained:
                raise UsageError(
                    f"--data {data}: input {name!r} is in {have}; the model was trained on {trained}: convert it first"
                )
        if lon_variable is None:
            lon_variable = lat_variable.replace("LAT", "LON").replace("lat", "lon")
        require_variables(ds, data, [lat_variable], "latitude (the training's lat_variable)")
        require_variables(ds, data, [lon_variable], "longitude (--lon-variable)")
        selection = select_patterns(
            ds,
            data,
            names=[*fields, lat_variable, lon_variable],  # also checks that lon/lat lie on the fields' grid
            mask_variable=mask_variable,
            lat_variable=lat_variable,
            min_abs_lat=min_abs_lat,
            thin=1,
            max_patterns=0,
            val_fraction=0.0,
            seed=0,
            **({} if hemisphere == "both" else {"hemisphere": hemisphere}),
        )
        x = torch.from_numpy(read_shard(ds, data, fields, selection.cells, 0, 1))
        template = grid_field(ds, fields[0], data)
        dims = tuple(str(d) for d in template.dims)
        lat_field, lon_field = grid_field(ds, lat_variable, data), grid_field(ds, lon_variable, data)
        lat_values, lon_values = np.asarray(lat_field.values), np.asarray(lon_field.values)
        lat_attrs, lon_attrs = dict(lat_field.attrs), dict(lon_field.attrs)
        long_names = {
            name: str(ds[field].attrs.get("long_name", name)) for name, field in zip(inputs, fields, strict=True)
        }

    # netCDF's default fill (9.97e36) is a cell never written: no more a value than NaN is.
    missing = (~torch.isfinite(x) | (x.abs() >= 9.0e36)).sum(dim=0)
    for name, count in zip(inputs, missing.tolist(), strict=True):
        if count:
            raise UsageError(
                f"--data {data}: input {name!r} has {count} missing values (NaN or fill) inside the sea-ice domain "
                f"({len(x)} cells: {where}); fill them or mask those cells"
            )

    predictions, jacobians = [], []
    with torch.no_grad():
        for start in range(0, len(x), PREDICT_CHUNK):
            p, j = run(x[start : start + PREDICT_CHUNK])
            predictions.append(p.double().cpu())
            jacobians.append(j.double().cpu())
    predictions, jacobian = torch.cat(predictions), torch.cat(jacobians)

    shape, cells = selection.grid_shape, selection.cells

    def on_grid(values: torch.Tensor) -> np.ndarray:
        grid = np.full(shape[0] * shape[1], np.nan)
        grid[cells] = values.numpy()
        return grid.reshape(shape)

    coordinates = f"{lon_variable} {lat_variable}"
    variables = {}
    for o, output in enumerate(outputs):
        variables[output] = xr.Variable(
            dims,
            on_grid(predictions[:, o]),
            {
                "long_name": f"{output} emulated by the UFS sea-ice emulator",
                "units": units.get(output, "1"),
                "coordinates": coordinates,
            },
        )
        for i, name in enumerate(inputs):
            variables[f"d{output}_d{name}"] = xr.Variable(
                dims,
                on_grid(jacobian[:, o, i]),
                {
                    "long_name": f"d {output} / d {name}: Jacobian of the emulated {output} with respect to "
                    f"{long_names[name]}",
                    "units": _units_per(units.get(output, "1"), units.get(name, "")),
                    "coordinates": coordinates,
                },
            )
    domain_mask = np.zeros(shape[0] * shape[1], dtype=np.int8)
    domain_mask[cells] = 1
    variables["domain_mask"] = xr.Variable(
        dims,
        domain_mask.reshape(shape),
        {
            "long_name": "emulated cells: the training's sea-ice domain",
            "comment": f"cells with {where}",
            "flag_values": np.array([0, 1], dtype=np.int8),
            "flag_meanings": "outside_domain inside_domain",
            "coordinates": coordinates,
        },
    )
    for name, values, attrs, axis, units_default in (
        (lat_variable, lat_values, lat_attrs, "latitude", "degrees_north"),
        (lon_variable, lon_values, lon_attrs, "longitude", "degrees_east"),
    ):
        attrs = {"long_name": axis, **attrs, "standard_name": axis, "units": attrs.get("units", units_default)}
        variables[name] = xr.Variable(dims, values, attrs)
    emulated = xr.Dataset(variables)
    emulated.attrs.update(
        {
            "Conventions": "CF-1.8",
            "title": "UFS sea-ice emulator: predictions and Jacobian in physical units",
            "source": source,
            "input_file": str(data),
            "history": f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} python -m toolkit.export "
            f"predict --data {data}",
        }
    )
    fill = {"_FillValue": FILL_VALUE, "dtype": "float64"}
    encoding = {
        name: (dict(fill) if name not in (lat_variable, lon_variable, "domain_mask") else {"_FillValue": None})
        for name in variables
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        emulated.to_netcdf(partial, engine="netcdf4", encoding=encoding)
        partial.replace(out)  # a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    return {
        "out": str(out),
        "cells": len(cells),
        "grid": list(shape),
        "source": source,
        "outputs": outputs,
        "inputs": inputs,
    }


def _torchscript_removed(args) -> None:
    raise UsageError(
        "torchscript export is gone (torch 2.13 deprecates TorchScript); use python -m toolkit.export aoti RUN_DIR "
        "--out emulator.pt2, which export/cpp/ loads"
    )


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toolkit.export", description=__doc__.split("\n\n")[0])
    formats = parser.add_subparsers(dest="format", required=True)
    aoti = formats.add_parser("aoti", help="an AOTInductor package (.pt2): predictions and Jacobian, physical units")
    aoti.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a trained run (runs/<recipe>/<run>)")
    aoti.add_argument("--out", type=Path, required=True, help="file to write, e.g. emulator.pt2")
    aoti.add_argument("--step", type=int, default=None, help="export this checkpoint instead of the best")
    predict = formats.add_parser("predict", help="predictions and Jacobian on a netCDF file's grid, to netCDF")
    predict.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", nargs="?", default=None, help="a trained run (or --model)"
    )
    predict.add_argument("--model", type=Path, default=None, help="an exported package (.pt2) instead of RUN_DIR")
    predict.add_argument("--data", type=Path, required=True, help="input netCDF file (the training's variables)")
    predict.add_argument("--out", type=Path, required=True, help="netCDF file to write, e.g. emulated.nc")
    predict.add_argument("--step", type=int, default=None, help="use this checkpoint of RUN_DIR instead of the best")
    predict.add_argument(
        "--lon-variable", default=None, help="longitude variable (default: the latitude's name with LAT -> LON)"
    )
    script = formats.add_parser("torchscript", help="removed: use aoti")
    script.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.format == "torchscript":
        _torchscript_removed(args)
    elif args.format == "aoti":
        meta = export_aoti(args.run_dir, args.out, args.step)
        print(
            f"wrote {args.out}: {meta['recipe']} from {meta['checkpoint']}, inputs {' '.join(meta['inputs'])} -> "
            f"outputs {' '.join(meta['outputs'])} and their Jacobian (physical units, float64)"
        )
    else:
        summary = predict_netcdf(
            args.data,
            args.out,
            run_dir=args.run_dir,
            model_path=args.model,
            step=args.step,
            lon_variable=args.lon_variable,
        )
        print(
            f"wrote {summary['out']}: {' '.join(summary['outputs'])} and d/d({' '.join(summary['inputs'])}) on "
            f"{summary['cells']} domain cells of a {summary['grid'][0]} x {summary['grid'][1]} grid, from "
            f"{summary['source']}"
        )


if __name__ == "__main__":
    main()
