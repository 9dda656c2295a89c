"""`python -m toolkit.export predict`: a model (a run's, or an exported package) on every cell of a netCDF file's
sea-ice domain, in steps: load the model (toolkit.export.load), derive the selection from the run's domain options
(selection_options: the one place they are read), read the domain's inputs from one file or an ocean/ice +
atmosphere pair as the training reads them (read_domain, through toolkit.data.ufs.open_fields: levels, Gaussian
axes, the pair matched by coordinate value, the inputs the run's domain gives as 0), predict in chunks
(predict_in_chunks), clip fractions to [0, 1] (clip_fractions), write the CF file on the grid (write_netcdf) or
SOCA's per-point file as IceEmul.h writes it (write_soca: float32, dimensions n and n_inputs), whole or not at all,
and draw the maps (toolkit.export.maps)."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import UsageError
from toolkit.export.load import load_package, load_run
from toolkit.process import extras

FILL_VALUE = 1.0e30  # CICE's spval: what its history files hold outside the ocean
PREDICT_CHUNK = 16384  # points per call: bounds the [chunk, width, inputs] Jacobian chain in memory
LAYOUTS = ("grid", "soca")  # the CF file on the input's grid, or SOCA's per-point file (IceEmul.h's predict)
FRACTIONS = ("aice",)  # outputs clipped to [0, 1] by predict
STANDARD_NAMES = {"aice": "sea_ice_area_fraction"}  # CF standard names of the outputs that have one
# SOCA's IceEmul.h names the Jacobian dc/d<x> (c: the ice concentration aice): dcdt = d aice / d sst (the ocean's
# temperature), dcds = d aice / d sss, dcdsi = d aice / d sice; the others keep our name (dcdtair, dcdtsfc, dcdhi,
# dcdhs as IceEmul.h; dcduocn, dcdqref, ... for the inputs IceEmul has not).
SOCA_INPUT_NAMES = {"sst": "t", "sss": "s", "sice": "si"}
# select_patterns' arguments that sample the training's patterns rather than draw its domain (thinning, caps, the
# validation coin, the ranks' strides): off for predicting, which takes every domain cell
SAMPLING = {"thin": 1, "max_patterns": 0, "max_patterns_per_rank": 0, "val_fraction": 0.0, "seed": 0, "world": 1}
# arguments of select_patterns / resolve_variables that read_domain fills itself (the files, the fields, the names)
NOT_OPTIONS = ("ds", "path", "names", "sources", "inputs", "outputs", "variables", "mask_variable", "lat_variable",
               "need_lat", "need_ice")


@dataclass
class Domain:
    """The inputs on the domain's cells (physical units, float64) and what writing them back on the grid needs."""

    x: torch.Tensor
    cells: np.ndarray
    grid_shape: tuple[int, int]
    dims: tuple[str, ...]
    where: str  # the selection in words, for messages and the file's domain_mask comment
    coordinates: dict  # {name: (values, attrs, "latitude" or "longitude")}, on the fields' grid
    long_names: dict
    truth: dict = field(default_factory=dict)  # {output: its values in the file at the cells}, where it has them
    time: tuple | None = None  # (the fields' leading length-1 dimension, its coordinate variable or None)
    land: np.ndarray | None = None  # the grid's cells outside the ocean mask (for the maps), None without a mask
    axes_1d: bool = False  # the coordinates were a Gaussian grid's 1-D axes: written back 1-D


def predict_netcdf(data: Path | str, out: Path | str, *, run_dir: Path | str | None = None,
                   model_path: Path | str | None = None, step: int | None = None,
                   lon_variable: str | None = None, data_atmos: Path | str | None = None, whole_grid: bool = False,
                   layout: str = "grid", plot_dir: Path | str | None = None, lat_variable: str | None = None) -> dict:
    """Predictions and Jacobian on every domain cell of `data` (with `data_atmos`: the pair), the domain as the run
    selected it (every ocean cell with `whole_grid`), written to `out` on its grid or per point (`layout` soca), and
    maps in `plot_dir` (toolkit.export's docstring); returns a summary (out, cells, domain, clipped, plots, ...)."""
    from toolkit.export.maps import check_plot_dir

    data, out = Path(data).expanduser(), Path(out).expanduser()
    atmos = None if data_atmos is None else Path(data_atmos).expanduser()
    if run_dir is not None and model_path is not None:
        raise UsageError(f"RUN_DIR {run_dir} and --model {model_path}: give one of them, not both")
    if run_dir is None and model_path is None:
        raise UsageError("give RUN_DIR (a trained run) or --model FILE.pt2 (an exported package) to predict with")
    if model_path is not None and step is not None:
        raise UsageError("--step picks a checkpoint of RUN_DIR; an exported --model has one already")
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout} is invalid; give one of {', '.join(LAYOUTS)}")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulated.nc")
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is a file, not a directory")
    for flag, given in (("--data", data), ("--data-atmos", atmos)):
        if given is not None and given.exists() and out.exists() and out.resolve() == given.resolve():
            raise UsageError(f"--out {out} is the {flag} file; give another file name")
    if atmos is not None and atmos.exists() and data.exists() and atmos.resolve() == data.resolve():
        raise UsageError(f"--data-atmos {atmos} is the --data file; give the atmosphere file, or leave --data-atmos "
                         "out when one file holds every variable")
    if plot_dir is not None:
        plot_dir = check_plot_dir(plot_dir)
        if plot_dir.absolute() == out.absolute() or out.absolute() in plot_dir.absolute().parents:
            raise UsageError(f"--plot {plot_dir} is --out {out} or inside it; give the maps a directory of their own")
        extras.pyplot()  # a missing extra is one line before the model loads
    extras.xarray()
    predict, meta, source = load_predictor(run_dir, model_path, step)
    if layout == "soca" and meta["outputs"] != ["aice"]:
        raise UsageError(f"--layout soca writes SOCA's aice_ffnn and its Jacobian dc/d<input>; this model emulates "
                         f"{', '.join(meta['outputs'])}: use --layout grid")
    domain = read_domain(data, meta, lon_variable, atmos=atmos, whole_grid=whole_grid, lat_variable=lat_variable)
    if not domain.coordinates and (layout == "soca" or plot_dir is not None):
        what = "--layout soca writes each point's lat and lon" if layout == "soca" else "--plot draws on latitudes"
        raise UsageError(f"{what}, and --data {data}{'' if atmos is None else f' (with --data-atmos {atmos})'} has "
                         "no latitude/longitude variable found by name (TLAT, ULAT, lat, latitude, standard_name "
                         "latitude): give --lat-variable and --lon-variable")
    predictions, jacobian = predict_in_chunks(predict, domain.x)
    predictions, clipped = clip_fractions(predictions, meta["outputs"])
    writer = write_soca if layout == "soca" else write_netcdf
    writer(out, domain, predictions, jacobian, meta, source, data, clipped, atmos=atmos)
    plots = []
    if plot_dir is not None:
        from toolkit.export.maps import draw_maps

        lat, lon = (values for values, _, _ in domain.coordinates.values())  # latitude first
        plots = draw_maps(plot_dir, map_fields(meta, domain, predictions, jacobian), lat, lon, domain.land)
    return {"out": str(out), "cells": len(domain.cells), "grid": list(domain.grid_shape), "source": source,
            "outputs": meta["outputs"], "inputs": meta["inputs"], "layout": layout, "plots": [str(p) for p in plots],
            "domain": domain.where, "whole_grid": whole_grid, "clipped": clipped}


def load_predictor(run_dir, model_path, step):
    """(x -> (predictions, jacobian), the model's meta, where it came from in words). A run's meta carries its whole
    config ("config": every domain option the training selected with); a package's, what its meta.json holds."""
    if model_path is not None:
        program, meta = load_package(model_path)
        return program, meta, f"{model_path} (exported from {meta.get('run_dir')} {meta.get('checkpoint')})"
    from toolkit.models.ufs_emulator import ExportedEmulator
    from toolkit.run.rundir import RunDir, read_json

    model, meta = load_run(run_dir, step)
    if "config" not in meta:
        meta["config"] = (read_json(RunDir(Path(run_dir)).config) or {}).get("config") or {}
    return ExportedEmulator(model), meta, f"{run_dir} {meta['checkpoint']}"


def selection_options(meta: dict, whole_grid: bool = False) -> dict:
    """select_patterns' keyword arguments that select the domain as the run's training did: the one place predict
    derives its selection. Every argument of select_patterns that the run's config holds under the same name passes
    through as the run had it (a domain option added to both flows here by itself); the mask and latitude are the
    names the training resolved ("auto" tried in order); open_water False is the ice variable aice (> 0 only);
    the training's sampling (thinning, caps, the validation coin) is off: every domain cell. whole_grid: every ocean
    cell (the mask only; every other option at select_patterns' default, the latitude bound 0). A package holds
    what its meta.json recorded (its "config" where present, else its "domain")."""
    from toolkit.data.ufs import select_patterns

    parameters = inspect.signature(select_patterns).parameters
    domain = meta.get("domain") or {}
    settings = {**domain, **(meta.get("config") or {})}
    options = {key: settings[key] for key in parameters
               if key in settings and key not in ("ds", "path", "names", "mask_variable", "lat_variable")}
    options["mask_variable"] = domain.get("mask_variable", "tmask")
    options["lat_variable"] = domain.get("lat_variable", "TLAT")  # "": the run read no latitude
    options["min_abs_lat"] = float(options.get("min_abs_lat", 0.0))
    if settings.get("open_water", True) is False and "ice_variable" in parameters and "open_water" not in parameters:
        options["ice_variable"] = "aice"
    options.update({key: value for key, value in SAMPLING.items() if key in parameters})
    if whole_grid:
        ocean = ocean_kind(options)
        for key in list(options):
            default = parameters[key].default
            if key not in ("mask_variable", "lat_variable", *SAMPLING) and default is not inspect.Parameter.empty:
                options[key] = default
        options["min_abs_lat"] = 0.0
        if "mask" in parameters:  # the run's ocean (a mask variable, or thickness-tair), ours to compare
            options["mask"] = ocean
    return options


def ocean_kind(options: dict) -> str:
    """The run's ocean as --whole-grid keeps it: thickness-tair where the run's mask was that, else its variable."""
    from toolkit.data.ufs_domains import DOMAINS

    rule = DOMAINS.get(options.get("domain", "toolkit"))
    kind = (rule.mask if rule is not None else None) or options.get("mask", "variable")
    return "thickness-tair" if kind == "thickness-tair" else "variable"


def describe_selection(options: dict) -> str:
    """The selection in words, e.g. "tmask > 0.5 and TLAT >= 40 and aice > 0"; an option predict has no words
    for (one select_patterns took on since) as name=value."""
    from toolkit.data.ufs import select_patterns

    parameters = inspect.signature(select_patterns).parameters
    mask, lat = options.get("mask_variable"), options.get("lat_variable")
    bound, hemisphere = float(options.get("min_abs_lat", 0.0)), options.get("hemisphere", "both")
    parts = [f"{mask} > 0.5"] if mask else []
    if bound > 0 or hemisphere != "both":
        parts.append({"both": f"|{lat}| >= {bound:g}", "north": f"{lat} >= {bound:g}",
                      "south": f"{lat} <= {-bound:g}"}.get(hemisphere, f"{lat}: {hemisphere}"))
    if options.get("ice_variable"):
        parts.append(f"{options['ice_variable']} > 0")
    described = {"mask_variable", "lat_variable", "min_abs_lat", "hemisphere", "ice_variable", *SAMPLING}
    for key in sorted(set(options) - described):
        if parameters[key].default is inspect.Parameter.empty or options[key] != parameters[key].default:
            parts.append(f"{key}={options[key]!r}")
    return " and ".join(parts) or "every cell"


def read_domain(data: Path, meta: dict, lon_variable: str | None, *, atmos: Path | None = None,
                whole_grid: bool = False, lat_variable: str | None = None) -> Domain:
    """The inputs on every cell of the domain of `data` (and `atmos`, on the same grid), read as the training reads
    them (toolkit.data.ufs.open_fields: the surface level of fields with a level dimension, a Gaussian file's 1-D
    axes broadcast, the pair matched by coordinate value, the inputs the run's domain gives as 0 as 0) and selected
    by select_patterns with selection_options (no thinning, no cap); each input under the name the training's file
    had for it where the file(s) hold that name, else found as the training finds it (ours, CICE's, CF's); the
    outputs' values where the file(s) hold them (the truth, for the error maps and SOCA's file); the cells'
    latitude and longitude: `lat_variable` (--lat-variable; it also bounds the domain where the run's domain has a
    latitude bound) or the training's, else the file's own (find_coordinates; a run that read no latitude asks for
    none), and `lon_variable` or the latitude's partner. Units that differ from the training's, and missing values
    inside the domain, are refused in one line."""
    from toolkit.data.ufs import (
        CF_NAMES,
        Source,
        candidate_names,
        find_variable,
        grid_field,
        never_written,
        open_dataset,
        open_fields,
        read_shard,
        resolve_variables,
        select_patterns,
    )
    inputs, outputs, units = meta["inputs"], meta["outputs"], meta.get("units") or {}
    config = meta.get("config") or {}
    options = selection_options(meta, whole_grid)
    if lat_variable and options.get("lat_variable"):  # the domain's bound reads the latitude named here
        options["lat_variable"] = lat_variable
    where = describe_selection(options)
    mask_variable, bound_lat = options["mask_variable"], options.get("lat_variable") or ""
    ice = options.get("ice_variable") or ""
    zeroed = [name for name in meta.get("zeroed") or [] if name in inputs]  # as the run trained on them
    trained_atmos = config.get("data_atmos")
    with contextlib.ExitStack() as files:  # the names the training's files had, where these files hold them
        sources = [Source("--data", data, files.enter_context(open_dataset(data)))]
        if atmos is not None:
            sources.append(Source("--data-atmos", atmos, files.enter_context(open_dataset(atmos, "--data-atmos"))))
        named = " and ".join(f"{s.flag} {s.path}" for s in sources)
        present = {str(v) for s in sources for v in s.ds.variables}
        if ice and find_variable(sources, candidate_names(ice, meta.get("variables")),
                                 CF_NAMES.get(ice, ())) is None:
            raise UsageError(f"{named}: the run left open water out (--no-open-water), which needs the ice fraction "
                             f"{ice!r} (nor {', '.join(candidate_names(ice)[1:])}); give a file with it, or "
                             "--whole-grid to predict on every ocean cell")
        if bound_lat and bounds_latitude(options) and bound_lat not in present:
            given = "--lat-variable's" if lat_variable else "the training's"
            raise UsageError(f"{named} {'have' if atmos else 'has'} no latitude variable {bound_lat!r} ({given}, "
                             f"for the run's domain: {where}); give --lat-variable NAME, or --whole-grid to predict "
                             "on every ocean cell")
    trained_names = {name: variable for name, variable in (meta.get("variables") or {}).items()
                     if name in (*inputs, *outputs) and variable in present}
    # the options that decide which variables the selection reads (a team's domain: aice, ...) pass on too
    resolving = {key: value for key, value in options.items()
                 if key in inspect.signature(resolve_variables).parameters and key not in NOT_OPTIONS}
    coordinate_lat = lat_variable or bound_lat or None
    path = data if atmos is None else f"{data} (with --data-atmos {atmos})"
    with contextlib.ExitStack() as stack:
        try:
            fields = stack.enter_context(open_fields(
                data, atmos, inputs=inputs, outputs=[], variables=trained_names, mask_variable=mask_variable,
                lat_variable=bound_lat or "auto", need_lat=bool(bound_lat) and bounds_latitude(options),
                need_ice=bool(ice), zeroed=zeroed, optional=outputs, coordinates=(coordinate_lat, lon_variable),
                **resolving))
        except UsageError as error:
            if trained_atmos and atmos is None:
                raise UsageError(f"{error}; the run was trained with --data-atmos {trained_atmos}: give the "
                                 "atmosphere file as --data-atmos") from None
            raise
        view, found = fields.view, fields.found
        for name in inputs:
            have, trained = str(view[name].attrs.get("units", "")), units.get(name, "")
            if name not in zeroed and have and trained and have != trained:
                raise UsageError(
                    f"--data {path}: input {name!r} is in {have}; the model was trained on {trained}: convert it first"
                )
        lat_key, lon_key = fields.coordinates
        selection = select_patterns(  # names: lat/lon too, so select_patterns checks they lie on the fields' grid
            view, path, names=[*inputs, *(key for key in (lat_key, lon_key) if key)],
            **{**options, "mask_variable": fields.mask_key, "lat_variable": fields.lat}
        )
        where = getattr(selection, "where", "") or where  # the selection's own words where it has them
        x = torch.from_numpy(read_shard(view, path, inputs, selection.cells, 0, 1))
        truth = {output: torch.from_numpy(read_shard(view, path, [output], selection.cells, 0, 1)[:, 0])
                 for output in outputs if output in found}
        first = (inputs[0], grid_field(view, inputs[0], path))
        dims = tuple(str(d) for d in first[1].dims)
        coordinates = {}
        for name, axis in ((lat_key, "latitude"), (lon_key, "longitude")):
            if name:
                grid = grid_field(view, name, path, like=first)
                coordinates[name] = (np.asarray(grid.values), dict(grid.attrs), axis)
        land = None
        if fields.mask_key:
            mask = np.asarray(grid_field(view, fields.mask_key, path, like=first).values, dtype=np.float64)
            land = ~(np.nan_to_num(mask) > 0.5)
        elif "thick" in found and "tair" in view.variables:  # thickness-tair: its ocean
            from toolkit.data.ufs_domains import thickness_tair_ocean

            ocean = thickness_tair_ocean(np.asarray(grid_field(view, "thick", path, like=first).values),
                                         np.asarray(grid_field(view, "tair", path, like=first).values))
            land = ~ocean
        long_names = {name: str(view[name].attrs.get("long_name", name)) for name in inputs}
        time, axes_1d = fields.time, fields.axes_1d
    missing = (~torch.isfinite(x) | never_written(x)).sum(dim=0)  # a cell never written is no more a value than NaN
    for name, count in zip(inputs, missing.tolist(), strict=True):
        if count:
            raise UsageError(
                f"--data {path}: input {name!r} has {count} missing values (NaN or fill) inside the sea-ice domain "
                f"({len(x)} cells: {where}); fill them or mask those cells"
            )
    truth = {name: torch.where(never_written(values), torch.nan, values) for name, values in truth.items()}
    return Domain(x, selection.cells, selection.grid_shape, dims, where, coordinates, long_names, truth, time, land,
                  axes_1d)


def bounds_latitude(options: dict) -> bool:
    """Whether the selection reads a latitude: a pole's team, or ours with a bound or one hemisphere."""
    from toolkit.data.ufs_domains import domain_rule

    domain = options.get("domain", "toolkit")
    if domain != "toolkit":
        return domain_rule(domain).pole
    return float(options.get("min_abs_lat", 0.0)) > 0 or options.get("hemisphere", "both") != "both"


def predict_in_chunks(predict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions [n, outputs], jacobian [n, outputs, inputs]) in float64 on the CPU, PREDICT_CHUNK points a call."""
    predictions, jacobians = [], []
    with torch.no_grad():
        for start in range(0, len(x), PREDICT_CHUNK):
            p, j = predict(x[start : start + PREDICT_CHUNK])
            predictions.append(p.double().cpu())
            jacobians.append(j.double().cpu())
    return torch.cat(predictions), torch.cat(jacobians)


def clip_fractions(predictions: torch.Tensor, outputs) -> tuple[torch.Tensor, dict]:
    """Fractions (FRACTIONS, e.g. aice) clipped to [0, 1]; ({output: cells clipped}) beside. The Jacobian stays the
    network's (at a clipped cell the clipped value's derivative would be 0)."""
    clipped = {}
    predictions = predictions.clone()
    for o, output in enumerate(outputs):
        if output in FRACTIONS:
            column = predictions[:, o]
            clipped[output] = int(((column < 0) | (column > 1)).sum())
            predictions[:, o] = column.clamp(0.0, 1.0)
    return predictions, clipped


def clip_attributes(clipped: dict, cells: int) -> dict:
    """The file's attributes for the clipping: <output>_clipped_share (of the domain's cells) and the count."""
    attributes = {}
    for output, count in clipped.items():
        attributes[f"{output}_clipped_share"] = count / max(cells, 1)
        attributes[f"{output}_clipped_cells"] = np.int64(count)
    return attributes


def output_attributes(output: str, units: dict, clipped: dict, what: str) -> dict:
    attributes = {"long_name": f"{output} {what}", "units": units.get(output, "1")}
    if output in STANDARD_NAMES:
        attributes["standard_name"] = STANDARD_NAMES[output]
    if output in clipped:
        attributes["comment"] = "clipped to [0, 1] (the share of cells clipped: the file's " \
                                f"{output}_clipped_share attribute)"
    return attributes


def file_attributes(title: str, source: str, data: Path, atmos: Path | None, clipped: dict, cells: int,
                    where: str) -> dict:
    inputs = f"--data {data}" + ("" if atmos is None else f" --data-atmos {atmos}")
    return {
        "Conventions": "CF-1.8",
        "title": title,
        "source": source,
        "input_file": str(data),
        **({} if atmos is None else {"input_file_atmosphere": str(atmos)}),
        "domain": f"cells with {where}",
        **clip_attributes(clipped, cells),
        "history": f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} python -m toolkit.export "
        f"predict {inputs}",
    }


def write_whole(dataset, out: Path, encoding: dict, dimensions: dict | None = None) -> None:
    """Written to a temporary sibling and renamed: a reader never sees half a file. `dimensions` {name: size}: more
    dimensions in the file, which no variable uses (SOCA's n_inputs)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        dataset.to_netcdf(partial, engine="netcdf4", encoding=encoding)
        if dimensions:
            import netCDF4

            with netCDF4.Dataset(partial, "a") as written:
                for name, size in dimensions.items():
                    written.createDimension(name, size)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)


def write_netcdf(out: Path, domain: Domain, predictions: torch.Tensor, jacobian: torch.Tensor, meta: dict,
                 source: str, data: Path, clipped: dict | None = None, atmos: Path | None = None) -> None:
    """OUT.nc on the input's grid: each output, its Jacobian as d<output>_d<input>, the coordinates and domain_mask;
    fill values outside the domain; CF attributes (aice: standard_name sea_ice_area_fraction); the input's leading
    time dimension, where it has one, on every output and Jacobian variable. Whole or not at all."""
    xr = extras.xarray()
    inputs, outputs, units = meta["inputs"], meta["outputs"], meta.get("units") or {}
    clipped = clipped or {}
    shape, cells, dims = domain.grid_shape, domain.cells, domain.dims
    time_dims = dims if domain.time is None else (domain.time[0], *dims)

    def on_grid(values: torch.Tensor) -> np.ndarray:
        grid = np.full(shape[0] * shape[1], np.nan)
        grid[cells] = values.numpy()
        return grid.reshape(shape if domain.time is None else (1, *shape))

    coordinates = " ".join(reversed(list(domain.coordinates)))  # "TLON TLAT"; "" without coordinates
    variables = {}
    for o, output in enumerate(outputs):
        variables[output] = xr.Variable(time_dims, on_grid(predictions[:, o]), {
            **output_attributes(output, units, clipped, "emulated by the UFS sea-ice emulator"),
            **({"coordinates": coordinates} if coordinates else {}),
        })
        for i, name in enumerate(inputs):
            variables[f"d{output}_d{name}"] = xr.Variable(time_dims, on_grid(jacobian[:, o, i]), {
                "long_name": f"d {output} / d {name}: Jacobian of the emulated {output} with respect to "
                f"{domain.long_names[name]}",
                "units": units_per(units.get(output, "1"), units.get(name, "")),
                **({"coordinates": coordinates} if coordinates else {}),
            })
    domain_mask = np.zeros(shape[0] * shape[1], dtype=np.int8)
    domain_mask[cells] = 1
    variables["domain_mask"] = xr.Variable(dims, domain_mask.reshape(shape), {
        "long_name": "emulated cells: the training's sea-ice domain",
        "comment": f"cells with {domain.where}",
        "flag_values": np.array([0, 1], dtype=np.int8),
        "flag_meanings": "outside_domain inside_domain",
        **({"coordinates": coordinates} if coordinates else {}),
    })
    for name, (values, attrs, axis) in domain.coordinates.items():
        default_units = "degrees_north" if axis == "latitude" else "degrees_east"
        attrs = {"long_name": axis, **attrs, "standard_name": axis, "units": attrs.get("units", default_units)}
        if domain.axes_1d:  # a Gaussian grid's axes, as the input holds them: latitude(rows), longitude(columns)
            row = axis == "latitude"
            variables[name] = xr.Variable((dims[0 if row else 1],), values[:, 0] if row else values[0, :], attrs)
        else:
            variables[name] = xr.Variable(dims, values, attrs)
    fixed = [*domain.coordinates, "domain_mask"]
    if domain.time is not None and domain.time[1] is not None:
        variables[domain.time[0]] = domain.time[1]
        fixed.append(domain.time[0])
    emulated = xr.Dataset(variables)
    emulated.attrs.update(file_attributes("UFS sea-ice emulator: predictions and Jacobian in physical units", source,
                                          data, atmos, clipped, len(cells), domain.where))
    fill = {"_FillValue": FILL_VALUE, "dtype": "float64"}
    encoding = {name: (dict(fill) if name not in fixed else {"_FillValue": None}) for name in variables}
    write_whole(emulated, out, encoding)


def soca_name(name: str) -> str:
    """The Jacobian column's name in SOCA's per-point file: dc/d<input> (SOCA_INPUT_NAMES, else our name)."""
    return f"dcd{SOCA_INPUT_NAMES.get(name, name)}"


def write_soca(out: Path, domain: Domain, predictions: torch.Tensor, jacobian: torch.Tensor, meta: dict,
               source: str, data: Path, clipped: dict | None = None, atmos: Path | None = None) -> None:
    """SOCA's per-point file as IceEmul.h's predict writes it (netCDF::NcFile, replace): the dimensions n (the
    domain's cells, in the grid's order) and n_inputs (the model's inputs; no variable uses it), every variable
    float32 (ncFloat) on n: lon and lat per point, the truth aice (where the input holds it), the emulated
    aice_ffnn, and the Jacobian as dc/d<input> (soca_name: dcdt = d aice / d sst, dcds, dcdsi, dcdtair, dcdtsfc,
    dcdhi, dcdhs, ...), physical units. Whole or not at all."""
    xr = extras.xarray()
    inputs, units = meta["inputs"], meta.get("units") or {}
    clipped = clipped or {}
    cells = domain.cells
    variables = {}
    for name, (values, attrs, axis) in domain.coordinates.items():
        short = "lat" if axis == "latitude" else "lon"
        variables[short] = xr.Variable(("n",), np.asarray(values, dtype=np.float64).ravel()[cells], {
            "long_name": axis, "standard_name": axis,
            "units": attrs.get("units", "degrees_north" if axis == "latitude" else "degrees_east"),
            "comment": f"{name} of the input file at each point",
        })
    if "aice" in domain.truth:
        variables["aice"] = xr.Variable(("n",), domain.truth["aice"].numpy(), {
            **output_attributes("aice", units, {}, "in the input file (the truth)"),
        })
    variables["aice_ffnn"] = xr.Variable(("n",), predictions[:, 0].numpy(), {
        **output_attributes("aice", units, clipped, "emulated by the UFS sea-ice emulator"),
    })
    for i, name in enumerate(inputs):
        variables[soca_name(name)] = xr.Variable(("n",), jacobian[:, 0, i].numpy(), {
            "long_name": f"d aice / d {name}: Jacobian of the emulated aice with respect to {domain.long_names[name]}",
            "units": units_per(units.get("aice", "1"), units.get(name, "")),
        })
    per_point = xr.Dataset(variables)
    per_point.attrs.update(file_attributes("UFS sea-ice emulator, SOCA's per-point layout (IceEmul.h): aice, "
                                           "aice_ffnn and dc/d<input>", source, data, atmos, clipped, len(cells),
                                           domain.where))
    per_point.attrs["jacobian_names"] = ", ".join(f"{soca_name(name)} = d aice / d {name}" for name in inputs)
    encoding = {name: {"_FillValue": None, "dtype": "float32"} for name in variables}
    write_whole(per_point, out, encoding, dimensions={"n_inputs": len(inputs)})


def map_fields(meta: dict, domain: Domain, predictions: torch.Tensor, jacobian: torch.Tensor) -> list:
    """What --plot maps (toolkit.export.maps.MapField, on the grid, NaN outside the domain): each output as
    predicted (clipped), its error (emulated - the input's) where the input holds it, each Jacobian column."""
    from toolkit.export.maps import MapField

    inputs, units = meta["inputs"], meta.get("units") or {}
    shape, cells = domain.grid_shape, domain.cells

    def on_grid(values: torch.Tensor) -> np.ndarray:
        grid = np.full(shape[0] * shape[1], np.nan)
        grid[cells] = values.numpy()
        return grid.reshape(shape)

    fields = []
    for o, output in enumerate(meta["outputs"]):
        unit = units.get(output, "1")
        kind = "fraction" if output in FRACTIONS else "signed"
        fields.append(MapField(output, f"emulated {output}", unit, on_grid(predictions[:, o]), kind))
        if output in domain.truth:
            fields.append(MapField(f"{output}_error", f"{output} error: emulated - input", unit,
                                   on_grid(predictions[:, o] - domain.truth[output])))
        for i, name in enumerate(inputs):
            fields.append(MapField(f"d{output}_d{name}", f"d {output} / d {name}", units_per(unit, units.get(name, "")),
                                   on_grid(jacobian[:, o, i])))
    return fields


def units_per(output_units: str, input_units: str) -> str:
    """d output / d input's units in udunits syntax, e.g. 1/K, 1/(m/s), 1/(W/m^2)."""
    if not input_units:
        return output_units
    below = input_units if re.fullmatch(r"[A-Za-z0-9_^]+", input_units) else f"({input_units})"
    return f"{output_units or '1'}/{below}"
