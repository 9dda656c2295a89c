"""`python -m toolkit.export predict`: a model (a run's, or an exported package) on every cell of a netCDF file's
sea-ice domain, in four steps: load the model (toolkit.export.load), read the domain's inputs as the training
selected them (read_domain), predict in chunks (predict_in_chunks), write the CF file whole or not at all
(write_netcdf)."""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit import extras
from toolkit.errors import UsageError
from toolkit.export.load import load_package, load_run

FILL_VALUE = 1.0e30  # CICE's spval: what its history files hold outside the ocean
PREDICT_CHUNK = 16384  # points per call: bounds the [chunk, width, inputs] Jacobian chain in memory


@dataclass
class Domain:
    """The inputs on the domain's cells (physical units, float64) and what writing them back on the grid needs."""

    x: torch.Tensor
    cells: np.ndarray
    grid_shape: tuple[int, int]
    dims: tuple[str, ...]
    where: str  # the selection in words, for messages and the file's domain_mask comment
    coordinates: dict  # {name: (values, attrs, "latitude" or "longitude")}
    long_names: dict


def predict_netcdf(data: Path | str, out: Path | str, *, run_dir: Path | str | None = None,
                   model_path: Path | str | None = None, step: int | None = None,
                   lon_variable: str | None = None) -> dict:
    """Predictions and Jacobian on every domain cell of `data`, written to `out` on its grid (toolkit.export's
    docstring); returns a summary (cells, model, out)."""
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
    extras.xarray()  # a missing extra is one line before the model loads
    predict, meta, source = load_predictor(run_dir, model_path, step)
    domain = read_domain(data, meta, lon_variable)
    predictions, jacobian = predict_in_chunks(predict, domain.x)
    write_netcdf(out, domain, predictions, jacobian, meta, source, data)
    return {"out": str(out), "cells": len(domain.cells), "grid": list(domain.grid_shape), "source": source,
            "outputs": meta["outputs"], "inputs": meta["inputs"]}


def load_predictor(run_dir, model_path, step):
    """(x -> (predictions, jacobian), the model's meta, where it came from in words)."""
    if model_path is not None:
        program, meta = load_package(model_path)
        return program, meta, f"{model_path} (exported from {meta.get('run_dir')} {meta.get('checkpoint')})"
    from toolkit.models.ufs_emulator import ExportedEmulator

    model, meta = load_run(run_dir, step)
    return ExportedEmulator(model), meta, f"{run_dir} {meta['checkpoint']}"


def read_domain(data: Path, meta: dict, lon_variable: str | None) -> Domain:
    """The inputs on every cell of `data`'s domain, selected as the training selected it (toolkit.data.ufs
    select_patterns with the run's mask and latitude variables, latitude bound and hemisphere; no thinning, no cap;
    open water stays in: aice is what is emulated), each input under the name the training's file had for it, else
    ours; units that differ from the training's, and missing values inside the domain, are refused in one line."""
    from toolkit.data.ufs import (
        grid_field,
        never_written,
        open_dataset,
        read_shard,
        require_variables,
        select_patterns,
    )

    inputs, units, domain = meta["inputs"], meta.get("units") or {}, meta.get("domain", {})
    mask_variable, lat_variable = domain.get("mask_variable", "tmask"), domain.get("lat_variable") or "TLAT"
    min_abs_lat, hemisphere = float(domain.get("min_abs_lat", 0.0)), domain.get("hemisphere", "both")
    where = {
        "both": f"|{lat_variable}| >= {min_abs_lat:g}",
        "north": f"{lat_variable} >= {min_abs_lat:g}",
        "south": f"{lat_variable} <= {-min_abs_lat:g}",
    }.get(hemisphere, hemisphere)
    where = f"{mask_variable} > 0.5 and {where}" if mask_variable else where
    with open_dataset(data) as ds:
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
            ds, data, names=[*fields, lat_variable, lon_variable],  # also checks that lon/lat lie on the fields' grid
            mask_variable=mask_variable, lat_variable=lat_variable, min_abs_lat=min_abs_lat, thin=1, max_patterns=0,
            val_fraction=0.0, seed=0, **({} if hemisphere == "both" else {"hemisphere": hemisphere}),
        )
        x = torch.from_numpy(read_shard(ds, data, fields, selection.cells, 0, 1))
        dims = tuple(str(d) for d in grid_field(ds, fields[0], data).dims)
        coordinates = {}
        for name, axis in ((lat_variable, "latitude"), (lon_variable, "longitude")):
            field = grid_field(ds, name, data)
            coordinates[name] = (np.asarray(field.values), dict(field.attrs), axis)
        long_names = {name: str(ds[field].attrs.get("long_name", name)) for name, field in zip(inputs, fields,
                                                                                             strict=True)}
    missing = (~torch.isfinite(x) | never_written(x)).sum(dim=0)  # a cell never written is no more a value than NaN
    for name, count in zip(inputs, missing.tolist(), strict=True):
        if count:
            raise UsageError(
                f"--data {data}: input {name!r} has {count} missing values (NaN or fill) inside the sea-ice domain "
                f"({len(x)} cells: {where}); fill them or mask those cells"
            )
    return Domain(x, selection.cells, selection.grid_shape, dims, where, coordinates, long_names)


def predict_in_chunks(predict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions [n, outputs], jacobian [n, outputs, inputs]) in float64 on the CPU, PREDICT_CHUNK points a call."""
    predictions, jacobians = [], []
    with torch.no_grad():
        for start in range(0, len(x), PREDICT_CHUNK):
            p, j = predict(x[start : start + PREDICT_CHUNK])
            predictions.append(p.double().cpu())
            jacobians.append(j.double().cpu())
    return torch.cat(predictions), torch.cat(jacobians)


def write_netcdf(out: Path, domain: Domain, predictions: torch.Tensor, jacobian: torch.Tensor, meta: dict,
                 source: str, data: Path) -> None:
    """OUT.nc on the input's grid: each output, its Jacobian as d<output>_d<input>, the coordinates and domain_mask;
    fill values outside the domain; CF attributes. Written to a temporary sibling and renamed: whole or not at all."""
    xr = extras.xarray()
    inputs, outputs, units = meta["inputs"], meta["outputs"], meta.get("units") or {}
    shape, cells, dims = domain.grid_shape, domain.cells, domain.dims

    def on_grid(values: torch.Tensor) -> np.ndarray:
        grid = np.full(shape[0] * shape[1], np.nan)
        grid[cells] = values.numpy()
        return grid.reshape(shape)

    lat_variable, lon_variable = domain.coordinates
    coordinates = f"{lon_variable} {lat_variable}"
    variables = {}
    for o, output in enumerate(outputs):
        variables[output] = xr.Variable(dims, on_grid(predictions[:, o]), {
            "long_name": f"{output} emulated by the UFS sea-ice emulator",
            "units": units.get(output, "1"),
            "coordinates": coordinates,
        })
        for i, name in enumerate(inputs):
            variables[f"d{output}_d{name}"] = xr.Variable(dims, on_grid(jacobian[:, o, i]), {
                "long_name": f"d {output} / d {name}: Jacobian of the emulated {output} with respect to "
                f"{domain.long_names[name]}",
                "units": units_per(units.get(output, "1"), units.get(name, "")),
                "coordinates": coordinates,
            })
    domain_mask = np.zeros(shape[0] * shape[1], dtype=np.int8)
    domain_mask[cells] = 1
    variables["domain_mask"] = xr.Variable(dims, domain_mask.reshape(shape), {
        "long_name": "emulated cells: the training's sea-ice domain",
        "comment": f"cells with {domain.where}",
        "flag_values": np.array([0, 1], dtype=np.int8),
        "flag_meanings": "outside_domain inside_domain",
        "coordinates": coordinates,
    })
    for name, (values, attrs, axis) in domain.coordinates.items():
        default_units = "degrees_north" if axis == "latitude" else "degrees_east"
        attrs = {"long_name": axis, **attrs, "standard_name": axis, "units": attrs.get("units", default_units)}
        variables[name] = xr.Variable(dims, values, attrs)
    emulated = xr.Dataset(variables)
    emulated.attrs.update({
        "Conventions": "CF-1.8",
        "title": "UFS sea-ice emulator: predictions and Jacobian in physical units",
        "source": source,
        "input_file": str(data),
        "history": f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} python -m toolkit.export "
        f"predict --data {data}",
    })
    fill = {"_FillValue": FILL_VALUE, "dtype": "float64"}
    encoding = {name: (dict(fill) if name not in (*domain.coordinates, "domain_mask") else {"_FillValue": None})
                for name in variables}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        emulated.to_netcdf(partial, engine="netcdf4", encoding=encoding)
        partial.replace(out)  # a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)


def units_per(output_units: str, input_units: str) -> str:
    """d output / d input's units in udunits syntax, e.g. 1/K, 1/(m/s), 1/(W/m^2)."""
    if not input_units:
        return output_units
    below = input_units if re.fullmatch(r"[A-Za-z0-9_^]+", input_units) else f"({input_units})"
    return f"{output_units or '1'}/{below}"
