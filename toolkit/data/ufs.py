"""UFS sea-ice emulator data: patterns (one grid cell = one pattern) from CICE/MOM6-style netCDF files.

    python -m toolkit.data.ufs synth --out data/gdas-like.nc [--seed 0] [--nlat 180] [--nlon 360] [--sigma 0.05]
    python -m toolkit.data.ufs synth --out ocean.nc --atmos-out atmos.nc --naming cice   # CICE history names, 2 files

Reading (xarray, netCDF4 engine): the input and output variables are chosen by our names (default: the 14 -> aice
set of the reference emulator); each is looked up in the file(s) under, in order, an explicit name (`variables`,
the recipe's --variables NAME=VAR), our name, the CICE history name (`sst_h`, `Tair_h`, `Qref_h`, `aice_h`, ...),
and its CF standard names (a variable of that name, or one whose `standard_name` attribute is it); the names found
are reported in one line (`describe_variables`). The inputs may come from two files on the same grid (ocean/ice
`--data` and atmosphere `--data-atmos`). A field may carry leading length-1 dimensions (CICE history files have
`time`).

The patterns are the cells of the sea-ice domain as the teams select it: ocean (the mask variable, `tmask` or
`umask`, "auto" tries those), poleward of `--min-abs-lat` in one hemisphere or both (from the latitude variable,
`TLAT` with tmask, `ULAT` with umask), optionally without open water (aice > 0 only); thinned to every `--thin`-th
cell, capped at `--max-patterns` cells, or at `--max-patterns-per-rank` x the process count (a keyed random subset,
the same whatever the process count) and split into training and validation by a keyed coin per cell.

Sharding as seed 001 does it: rank r of W reads only the values of patterns r, r+W, r+2W, ... . The normalisation
statistics are merged from those shards (count, mean, M2 in float64: toolkit.distributed.merge_moments); the
shards are then assembled in pattern order on every rank, so the training set, and with it the training, does not
depend on how the patterns were sharded.

Dimensions are matched by name, never by position: a field stored as (ni, nj) beside fields stored as (nj, ni) is
read transposed back (`by_name`); one whose dimension names share nothing with the first field's is refused on a
square grid, where sizes cannot tell rows from columns.

Bad input is one UsageError line naming the file and what is wrong: a missing or unreadable file, a missing
variable (with the names tried), two variables in one file for one input (naming both), two files on different
grids, a field that is not 2-D, an all-masked domain, latitudes outside -90 .. 90 in the masked cells, NaNs in a
field inside the domain (with their count), values outside the physical range of the field's units (with no
units attribute: of what its name names, in any of its usual units).

The generator writes such a file: the 14 fields on a lat/lon grid with plausible ranges and units (land cells are
fill values, as in model output), and aice = sigmoid(f(inputs)) + Gaussian noise of standard deviation sigma, with
f a known smooth function (`clean_aice`); sigma is in the file's attributes (`noise_sigma`), so the best
achievable validation RMSE is known. With naming="cice" the variables carry the CICE history names (plus `umask`,
`ULAT`, `ULON`); with an atmosphere file the atmospheric fields go there.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolkit import extras
from toolkit.data.cache import file_fingerprint
from toolkit.data.prepared import counted_over_ranks
from toolkit.data.rows import TensorRows
from toolkit.entry import one_line_errors
from toolkit.errors import UsageError
from toolkit.randomness import keyed_uniform

DEFAULT_INPUTS = (
    "sst",
    "sss",
    "tair",
    "tsfc",
    "hi",
    "hs",
    "sice",
    "uocn",
    "vocn",
    "uatm",
    "vatm",
    "qref",
    "flwdn",
    "fswdn",
)
DEFAULT_OUTPUTS = ("aice",)
FORMAT_VERSION = 1  # part of the data fingerprint: bump when the selection of patterns changes
VALIDATION_COIN, CAP_COIN = 11, 12  # purposes of the keyed per-cell coins

# Where a variable is found when no explicit name is given: our name first, then (in this order) the CICE history
# name the teams' files use, then CF standard names (as a variable name, or as a variable's standard_name).
CICE_NAMES = {
    "sst": "sst_h",
    "sss": "sss_h",
    "tair": "Tair_h",
    "tsfc": "Tsfc_h",
    "hi": "hi_h",
    "hs": "hs_h",
    "sice": "sice_h",
    "uocn": "uocn_h",
    "vocn": "vocn_h",
    "uatm": "uatm_h",
    "vatm": "vatm_h",
    "qref": "Qref_h",
    "flwdn": "flwdn_h",
    "fswdn": "fswdn_h",
    "aice": "aice_h",
}
CF_NAMES = {
    "sst": ("sea_surface_temperature",),
    "sss": ("sea_surface_salinity",),
    "tair": ("air_temperature",),
    "tsfc": ("sea_ice_surface_temperature", "surface_temperature"),
    "hi": ("sea_ice_thickness",),
    "hs": ("surface_snow_thickness",),
    "sice": ("sea_ice_salinity",),
    "uocn": ("sea_water_x_velocity",),
    "vocn": ("sea_water_y_velocity",),
    "uatm": ("x_wind", "eastward_wind"),
    "vatm": ("y_wind", "northward_wind"),
    "qref": ("specific_humidity",),
    "flwdn": ("surface_downwelling_longwave_flux_in_air",),
    "fswdn": ("surface_downwelling_shortwave_flux_in_air",),
    "aice": ("sea_ice_area_fraction",),
    "lat": ("latitude",),
}
AUTO = "auto"  # --mask-variable / --lat-variable: try the names below in order
MASK_NAMES = ("tmask", "umask")  # CICE's T-cell and U-cell (velocity point) ocean masks
LAT_FOR_MASK = {"tmask": "TLAT", "umask": "ULAT"}  # each mask's latitudes (CICE's staggered grid)
LAT_NAMES = ("TLAT", "ULAT", "lat", "latitude")
HEMISPHERES = ("both", "north", "south")
ATMOSPHERE_FIELDS = ("tair", "uatm", "vatm", "qref", "flwdn", "fswdn")  # what the generator's --atmos-out holds


# ---- reading ---------------------------------------------------------------------------------------------------


def open_dataset(path: Path | str, flag: str = "--data"):
    """The file as an xarray Dataset (lazy: values are read when indexed); `flag` names it in errors."""
    xr = extras.xarray()

    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise UsageError(
            f"{flag} {path} {what}; give a CICE/MOM6-style netCDF file "
            "(python -m toolkit.data.ufs synth --out FILE writes one)"
        )
    try:
        return xr.open_dataset(path, engine="netcdf4", decode_times=False)
    except Exception as error:  # netCDF4 raises OSError, ValueError, ... for files it cannot read
        raise UsageError(f"{flag} {path} is not a readable netCDF file ({type(error).__name__}: {error})") from None


def require_variables(ds, path: Path | str, names, what: str) -> None:
    missing = [name for name in names if name not in ds.variables]
    if missing:
        have = ", ".join(sorted(str(v) for v in ds.data_vars)[:30])
        raise UsageError(
            f"--data {path} has no {what} variable {missing[0]!r}"
            f"{f' (nor {missing[1:]})' if missing[1:] else ''}; the file has: {have}"
        )


def grid_field(ds, name: str, path: Path | str, like: tuple | None = None):
    """The variable as a 2-D (y, x) DataArray: leading length-1 dimensions (time) are dropped. With `like` (the first
    field: (its name, its 2-D DataArray)) its dimensions are matched to that field's BY NAME, never by position."""
    array = ds[name]
    while array.ndim > 2 and array.shape[0] == 1:
        array = array.isel({array.dims[0]: 0})
    if array.ndim != 2:
        raise UsageError(
            f"--data {path}: variable {name!r} has dimensions {dict(array.sizes)}; expected a 2-D "
            "grid field (leading length-1 dimensions such as time are allowed)"
        )
    return array if like is None else by_name(array, name, *like, path)


def by_name(array, name: str, like_name: str, like, path: Path | str):
    """`array` (2-D) with its dimensions in like's order, matched by name: a field stored as (ni, nj) beside fields
    stored as (nj, ni) is read transposed back, never row for column. With one name in common, that name fixes the
    order. With none, only sizes could tell, and only on a grid that is not square: there the array is taken as it
    is (another shape is refused by the caller's grid check); on a square grid it is refused."""
    own, dims = tuple(str(d) for d in array.dims), tuple(str(d) for d in like.dims)
    if own == dims:
        return array
    if set(own) == set(dims):
        return array.transpose(*dims)
    shared = set(own) & set(dims)
    if shared:
        common = shared.pop()
        return array if own.index(common) == dims.index(common) else array.transpose(*array.dims[::-1])
    if array.shape == like.shape and array.shape[0] == array.shape[1]:
        raise UsageError(
            f"--data {path}: variable {name!r} has dimensions ({', '.join(own)}), {like_name!r} has "
            f"({', '.join(dims)}): no name in common, and on a square {array.shape[0]} x {array.shape[1]} grid the "
            "sizes cannot tell rows from columns; give every field the same dimension names (ncrename -d OLD,NEW)"
        )
    return array


@dataclass
class Source:
    """One input file: the flag that named it, its path and its (lazy) Dataset."""

    flag: str
    path: Path
    ds: object


class FieldView:
    """Our names -> the DataArrays found for them in one or two files. It answers `view[name]`, `.variables`,
    `.data_vars` and `.attrs` as a Dataset does, so the readers below take it in place of one; no coordinates are
    merged (two files need not agree on them, only on the grid)."""

    def __init__(self, arrays: dict, attrs: dict):
        self.variables = self.data_vars = arrays
        self.attrs = attrs

    def __getitem__(self, name: str):
        return self.variables[name]


def candidate_names(name: str, variables: dict[str, str] | None = None) -> list[str]:
    """The variable names tried for our `name`: the explicit one alone, else ours, the CICE history name and the CF
    standard names."""
    if variables and name in variables:
        return [variables[name]]
    return [name, *([CICE_NAMES[name]] if name in CICE_NAMES else []), *CF_NAMES.get(name, ())]


def find_variable(sources: list[Source], candidates, standard_names=()) -> tuple[Source, str] | None:
    """The first candidate present (each name in every file, --data before --data-atmos, before the next name),
    then the first variable whose standard_name attribute is one of `standard_names`."""
    for candidate in candidates:
        for source in sources:
            if candidate in source.ds.variables:
                return source, candidate
    for standard in standard_names:
        for source in sources:
            for var_name, variable in source.ds.variables.items():
                if variable.attrs.get("standard_name") == standard:
                    return source, str(var_name)
    return None


def ambiguity(source: Source, name: str, what: str, candidates, standard_names) -> UsageError | None:
    """Two variables of one file that both name our `name` (two of its names tried, or a name and a standard_name,
    or two variables with one standard_name): one error naming both, else None. A precedence here would pick one
    without a word."""
    hits: dict[str, str] = {}
    for candidate in candidates:
        if candidate in source.ds.variables:
            hits.setdefault(candidate, "our name" if candidate == name else "the CICE history name"
                            if candidate == CICE_NAMES.get(name) else "a CF name")
    for var_name, variable in source.ds.variables.items():
        standard = variable.attrs.get("standard_name")
        if standard in standard_names:
            hits.setdefault(str(var_name), f"standard_name {standard}")
    if len(hits) < 2:
        return None
    (a, why_a), (b, why_b) = list(hits.items())[:2]
    more = f" (and {len(hits) - 2} more)" if len(hits) > 2 else ""
    return UsageError(
        f"{source.flag} {source.path}: {what} {name!r} is ambiguous: both {a!r} ({why_a}) and {b!r} ({why_b}) name "
        f"it{more}; choose one with --variables {name}=VAR"
    )


def _missing(sources: list[Source], name: str, what: str, tried: list[str], hint: str = "",
             standard: bool = False) -> UsageError:
    files = " and ".join(f"{s.flag} {s.path}" for s in sources)
    have = ", ".join(sorted({str(v) for s in sources for v in s.ds.data_vars})[:30])
    others = [t for t in tried if t != name]
    also = "; the CF names also as standard_name" if standard else ""
    nor = f" (nor {', '.join(repr(t) for t in others)}{also})" if others else ""
    return UsageError(
        f"{files} {'have' if len(sources) > 1 else 'has'} no {what} variable {name!r}{nor}{hint}; "
        f"{'the files have' if len(sources) > 1 else 'the file has'}: {have}"
    )


def resolve_variables(
    sources: list[Source],
    inputs,
    outputs,
    *,
    variables: dict[str, str] | None = None,
    mask_variable: str = AUTO,
    lat_variable: str = AUTO,
    need_lat: bool = True,
    need_ice: bool = False,
) -> tuple[dict[str, tuple[Source, str]], str, str]:
    """Find every field, the mask and the latitudes: ({our name or the mask/latitude name: (file, name there)},
    mask key ("" = none), latitude key ("" = not needed)). A name not found is one error naming the names tried."""
    found: dict[str, tuple[Source, str]] = {}
    wanted = [(name, "input") for name in inputs] + [(name, "output") for name in outputs]
    if need_ice and "aice" not in inputs and "aice" not in outputs:
        wanted.append(("aice", "ice fraction (for open water left out)"))
    for name, what in wanted:
        tried = candidate_names(name, variables)
        standard = () if variables and name in variables else CF_NAMES.get(name, ())
        hit = find_variable(sources, tried, standard)
        if hit is None:
            raise _missing(sources, tried[0], what, tried, standard=bool(standard))
        if not (variables and name in variables):  # an explicit name is the user's choice
            ambiguous = ambiguity(hit[0], name, what, tried, standard)
            if ambiguous is not None:
                raise ambiguous
        found[name] = hit
    mask = ""
    if mask_variable:
        tried = list(MASK_NAMES) if mask_variable == AUTO else [mask_variable]
        hit = find_variable(sources, tried)
        if hit is None:
            raise _missing(sources, tried[0], "mask", tried, ' (--mask-variable NAME; "" for every cell)')
        mask = hit[1]
        found[mask] = hit
    lat = ""
    if need_lat:
        if lat_variable == AUTO:
            paired = LAT_FOR_MASK.get(mask)
            tried = [*([paired] if paired else []), *[n for n in LAT_NAMES if n != paired]]
            hit = find_variable(sources, tried, CF_NAMES["lat"])
        else:
            tried = [lat_variable]
            hit = find_variable(sources, tried)
        if hit is None:
            raise _missing(sources, tried[0], "latitude", tried, " (--lat-variable NAME; or --min-abs-lat 0 and "
                           "--hemisphere both)", standard=lat_variable == AUTO)
        lat = hit[1]
        found[lat] = hit
    fields = {name: hit for name, hit in found.items() if name not in (mask, lat)}
    if len(sources) > 1 and all(source is sources[0] for source, _ in fields.values()):
        raise UsageError(
            f"{sources[1].flag} {sources[1].path}: no field was taken from it: {sources[0].flag} {sources[0].path} "
            f"(searched first) holds all of {', '.join(fields)}; leave {sources[1].flag} out"
        )
    check_same_grid(sources, fields)
    return found, mask, lat


def check_same_grid(sources: list[Source], found: dict[str, tuple[Source, str]]) -> None:
    """Two files must hold their fields on one grid: the first field of each decides (one error naming both; the
    second's dimensions matched to the first's by name)."""
    first: dict[str, tuple[str, Source]] = {}
    for source, var in found.values():
        if source.flag not in first:
            first[source.flag] = (var, source)
    if len(first) < 2:
        return
    (a, (var_a, source_a)), (b, (var_b, source_b)) = first.items()
    array_a = grid_field(source_a.ds, var_a, source_a.path)
    both = f"{source_a.path} (with {b} {source_b.path})"
    shape_a = tuple(array_a.shape)
    shape_b = tuple(grid_field(source_b.ds, var_b, both, like=(var_a, array_a)).shape)
    if shape_a != shape_b:
        path = {s.flag: s.path for s in sources}
        raise UsageError(
            f"{a} {path[a]} and {b} {path[b]} are on different grids: {var_a!r} is {shape_a} in the first, "
            f"{var_b!r} is {shape_b} in the second; the ocean and atmosphere files must share one grid"
        )


def describe_variables(meta: dict) -> str:
    """One line: our name <- the name found, for every field, the mask and the latitudes (the teams' files use
    CICE history names; this says which were taken)."""
    names = meta["variables"]
    parts = [f"{name}<-{names[name]}" for name in [*meta["inputs"], *meta["outputs"]]]
    parts += [f"{what}<-{meta[key]}" for what, key in (("mask", "mask_variable"), ("lat", "lat_variable"))
              if meta.get(key)]
    atmosphere = meta.get("from_atmosphere") or []
    tail = f"; from --data-atmos: {', '.join(atmosphere)}" if atmosphere else ""
    return f"variables: {', '.join(parts)}{tail}"


@dataclass
class Selection:
    """The patterns: flat cell numbers of the grid (ascending) and which of them are validation patterns."""

    cells: np.ndarray
    is_valid: np.ndarray
    grid_shape: tuple[int, int]
    domain_cells: int  # cells in the sea-ice domain before thinning and capping


# Plausible values by unit (the `units` attribute, so CICE and CF names alike), and for the ice fraction by name.
PHYSICAL_RANGES = {
    "K": (150.0, 350.0),
    "degC": (-120.0, 80.0),
    "C": (-120.0, 80.0),  # CICE history files (sst_h, Tair_h, Tsfc_h)
    "psu": (0.0, 60.0),
    "ppt": (0.0, 60.0),  # CICE's sss_h, sice_h
    "g/kg": (0.0, 100.0),  # CICE's Qref_h
    "m": (0.0, 50.0),
    "m/s": (-150.0, 150.0),
    "kg/kg": (0.0, 0.1),
    "W/m^2": (-100.0, 2000.0),
    "W m-2": (-100.0, 2000.0),
}
FRACTIONS = {"aice", "aice_h"}  # sea-ice concentration: 0 .. 1 (with a margin for noise)
# A field with no `units` attribute: the plausible range of what our name names, in any of its usual units (a
# temperature in K or degC, a humidity in kg/kg or g/kg), so that a 1e4 K cell is refused all the same.
_TEMPERATURE = (-120.0, 350.0)
NAMED_RANGES = {
    "sst": _TEMPERATURE,
    "tair": _TEMPERATURE,
    "tsfc": _TEMPERATURE,
    "sss": (0.0, 60.0),
    "sice": (0.0, 60.0),
    "hi": (0.0, 50.0),
    "hs": (0.0, 50.0),
    "uocn": (-150.0, 150.0),
    "vocn": (-150.0, 150.0),
    "uatm": (-150.0, 150.0),
    "vatm": (-150.0, 150.0),
    "qref": (0.0, 100.0),
    "flwdn": (-100.0, 2000.0),
    "fswdn": (-100.0, 2000.0),
}


def physical_range(name: str, units: str, factor: float = 1.0) -> tuple[float, float] | None:
    """(low, high) a field's values must lie in, widened around its centre by `factor` (0: no check): by its units,
    and with no units by what our `name` names (NAMED_RANGES); None when neither its name nor its units are known."""
    # A fraction is 0..1; the margin lets observation-like noise through (the generator adds N(0, sigma^2)).
    if name in FRACTIONS:
        limits = (-0.25, 1.25)
    else:
        limits = PHYSICAL_RANGES.get(units.strip()) if units.strip() else NAMED_RANGES.get(name)
    if limits is None or factor == 0:
        return None
    centre, half = (limits[0] + limits[1]) / 2, (limits[1] - limits[0]) / 2 * factor
    return centre - half, centre + half


def select_patterns(
    ds,
    path,
    *,
    names,
    mask_variable: str,
    lat_variable: str,
    min_abs_lat: float,
    thin: int,
    max_patterns: int,
    val_fraction: float,
    seed: int,
    hemisphere: str = "both",
    ice_variable: str = "",
) -> Selection:
    """Domain cells (ocean, |lat| >= min_abs_lat in the `hemisphere`: north, south or both; with `ice_variable`
    only cells where it is > 0, i.e. open water left out), every `thin`-th, at most `max_patterns` (keyed subset),
    with a keyed validation coin per cell. Reads only the mask, latitude and ice fields; identical on every rank."""
    if hemisphere not in HEMISPHERES:
        raise UsageError(f"--hemisphere {hemisphere} is invalid; give one of {', '.join(HEMISPHERES)}")
    first = (names[0], grid_field(ds, names[0], path))  # every other field's dimensions are matched to its by name
    shape = first[1].shape
    for name in names:
        kind = grid_field(ds, name, path).dtype.kind
        if kind not in "fiub":
            raise UsageError(f"--data {path}: variable {name!r} holds {grid_field(ds, name, path).dtype} values, not "
                             "numbers; every input and output must be a numeric field")
    for name in names[1:]:
        if grid_field(ds, name, path, like=first).shape != shape:
            raise UsageError(
                f"--data {path}: variable {name!r} has grid {grid_field(ds, name, path, like=first).shape}, "
                f"{names[0]!r} has {shape}; every field must be on the same grid"
            )
    domain = np.ones(shape, dtype=bool)
    if mask_variable:
        require_variables(ds, path, [mask_variable], 'mask (--mask-variable; "" for none)')
        mask = grid_field(ds, mask_variable, path, like=first)
        if mask.shape != shape:
            raise UsageError(f"--data {path}: mask {mask_variable!r} has grid {mask.shape}, the fields {shape}; "
                             "the mask must be on the fields' grid")
        if mask.dtype.kind not in "fiub":
            raise UsageError(f"--data {path}: mask {mask_variable!r} holds {mask.dtype} values; a mask is 0/1 numbers")
        domain &= np.nan_to_num(np.asarray(mask.values, dtype=np.float64)) > 0.5
    if min_abs_lat > 0 or hemisphere != "both":
        require_variables(ds, path, [lat_variable], "latitude (--lat-variable; or --min-abs-lat 0)")
        lat_field = grid_field(ds, lat_variable, path, like=first)
        if lat_field.dtype.kind not in "fiu":
            raise UsageError(f"--data {path}: latitude {lat_variable!r} holds {lat_field.dtype} values; latitudes are "
                             "degrees north (numbers)")
        lat = np.asarray(lat_field.values, dtype=np.float64)
        if lat.shape != shape:
            raise UsageError(f"--data {path}: latitude {lat_variable!r} has grid {lat.shape}, the fields {shape}")
        off_earth = domain & np.isfinite(lat) & (np.abs(lat) > 90)  # the cells the mask keeps (land may hold fill)
        if off_earth.any():
            raise UsageError(
                f"--data {path}: latitude {lat_variable!r} has {int(off_earth.sum())} values outside -90 .. 90 "
                f"(e.g. {lat[off_earth][0]:g}) in the cells the mask keeps; latitudes are degrees north: check the "
                "file, or name the latitude variable with --lat-variable"
            )
        lat = np.nan_to_num(lat)
        poleward = {"both": np.abs(lat), "north": lat, "south": -lat}[hemisphere]
        domain &= poleward >= min_abs_lat
    if ice_variable:
        ice = grid_field(ds, ice_variable, path, like=first)
        if ice.shape != shape:
            raise UsageError(f"--data {path}: {ice_variable!r} has grid {ice.shape}, the fields {shape}")
        domain &= np.nan_to_num(np.asarray(ice.values, dtype=np.float64)) > 0
    cells = np.flatnonzero(domain.ravel())
    domain_cells = len(cells)
    if domain_cells == 0:
        where = []
        if mask_variable:
            where.append(f"{mask_variable} > 0.5")
        if min_abs_lat > 0 or hemisphere != "both":
            where.append({"both": f"|{lat_variable}| >= {min_abs_lat}", "north": f"{lat_variable} >= {min_abs_lat}",
                          "south": f"{lat_variable} <= {-min_abs_lat:g}"}[hemisphere])
        if ice_variable:
            where.append(f"{ice_variable} > 0")
        raise UsageError(
            f"--data {path}: the sea-ice domain is empty: no cell has {' and '.join(where) or 'data'}; "
            "check --mask-variable / --min-abs-lat / --hemisphere / --no-open-water"
        )
    cells = cells[::thin]
    if max_patterns and len(cells) > max_patterns:
        coins = keyed_uniform(seed, CAP_COIN, 0, torch.from_numpy(cells)).numpy()
        cells = np.sort(cells[np.argsort(coins, kind="stable")[:max_patterns]])
    is_valid = keyed_uniform(seed, VALIDATION_COIN, 0, torch.from_numpy(cells)).numpy() < val_fraction
    return Selection(cells, is_valid, tuple(shape), domain_cells)


def read_shard(ds, path, names, cells: np.ndarray, rank: int, world: int) -> np.ndarray:
    """[len(cells[rank::world]), len(names)] float64: this rank's strided share of the patterns (seed 001's
    `for i in range(rank, n, size)`), read by point indexing so only those cells' values are taken."""
    xr = extras.xarray()

    mine = cells[rank::world]
    columns = []
    first = (names[0], grid_field(ds, names[0], path)) if names else None
    for name in names:
        array = grid_field(ds, name, path, like=first)  # dimensions matched to the first field's by name
        rows, cols = np.unravel_index(mine, array.shape)
        points = array.isel(
            {array.dims[0]: xr.DataArray(rows, dims="pattern"), array.dims[1]: xr.DataArray(cols, dims="pattern")}
        )
        columns.append(np.asarray(points.values, dtype=np.float64))
    return np.stack(columns, axis=1) if columns else np.zeros((len(mine), 0))


def assemble_strided(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of the strided sharding: pattern g = r + W k is row k of shard r."""
    world, total = len(shards), sum(len(s) for s in shards)
    out = torch.empty((total, *shards[0].shape[1:]), dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        out[rank::world] = shard
    return out


def gather_strided(accelerator, shard: torch.Tensor, total: int) -> torch.Tensor:
    """Every rank's strided shard, assembled in pattern order on every rank (one all-gather, padded rows cut)."""
    world = accelerator.num_processes
    if world == 1:
        return shard
    longest = math.ceil(total / world)
    padded = torch.zeros((longest, *shard.shape[1:]), dtype=shard.dtype)
    padded[: len(shard)] = shard
    gathered = accelerator.gather(padded.to(accelerator.device)).cpu().reshape(world, longest, *shard.shape[1:])
    return assemble_strided([gathered[r, : len(range(r, total, world))] for r in range(world)])


class PatternRows(TensorRows):
    """TensorRows that hands the DataLoader a whole batch at once (one index per field instead of a dict per row:
    at batch 1000 the per-row collate costs more than the MLP's step). Use with collate_fn=whole_batch."""

    def __getitems__(self, indices) -> dict[str, torch.Tensor]:
        rows = self.rows[torch.as_tensor(indices, dtype=torch.long)]
        return {self.index_name: rows, **{name: value[rows] for name, value in self.fields.items()}}


def whole_batch(batch):
    """collate_fn for PatternRows: the batch is already assembled."""
    return batch


@dataclass
class UfsPatterns:
    """Physical-unit float64 patterns (the same on every rank) and the normalisation statistics."""

    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    valid_inputs: torch.Tensor
    valid_targets: torch.Tensor
    input_mean: torch.Tensor
    input_std: torch.Tensor
    output_mean: torch.Tensor
    output_std: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


def never_written(values: torch.Tensor) -> torch.Tensor:
    """Where a field holds netCDF's default fill value for floats (9.97e36): cells nothing was written to, which no
    reader decodes to NaN without a _FillValue attribute."""
    return values.abs() >= 9.0e36


def patterns_fingerprint(path: Path, atmos_path: Path | None, meta: dict, thin: int,
                         max_patterns_per_rank: int) -> str:
    """What the patterns are made from: the content of both files (either changing changes the data) and, when a cap
    per process cut the domain, the number taken (another process count is another subset, which a resume must
    refuse). The selection flags themselves are config.json's, compared on resume."""
    fingerprint = file_fingerprint(path, FORMAT_VERSION)
    if atmos_path is not None:
        fingerprint += "+" + file_fingerprint(atmos_path, FORMAT_VERSION)
    if max_patterns_per_rank and meta["patterns"] < math.ceil(meta["domain_cells"] / thin):
        fingerprint += f"/{meta['patterns']}"
    return fingerprint


def load_patterns(
    accelerator,
    path: Path | str,
    *,
    inputs=DEFAULT_INPUTS,
    outputs=DEFAULT_OUTPUTS,
    mask_variable: str = AUTO,
    lat_variable: str = AUTO,
    min_abs_lat: float = 40.0,
    thin: int = 1,
    max_patterns: int = 0,
    val_fraction: float = 0.1,
    seed: int = 0,
    range_factor: float = 1.0,
    atmos_path: Path | str | None = None,
    variables: dict[str, str] | None = None,
    hemisphere: str = "both",
    open_water: bool = True,
    max_patterns_per_rank: int = 0,
) -> UfsPatterns:
    """Find the variables (explicit `variables` {our name: name in the file}, else ours, CICE's, CF's; in `path`
    and the optional atmosphere file `atmos_path`, which must be on the same grid), select the patterns (the mask:
    "auto" tries tmask then umask, "" none; the latitudes: "auto" takes the mask's own, TLAT or ULAT, first;
    `hemisphere`; `open_water` False leaves aice <= 0 out; a cap of `max_patterns`, or of `max_patterns_per_rank`
    x the process count, the smaller), read this rank's strided share, refuse NaNs (counted over all ranks), merge
    the training statistics over the ranks (float64 count/mean/M2; a std below 1e-6 becomes 1), then assemble every
    shard in pattern order on every rank. A collective: every rank calls it."""
    from toolkit.distributed import merge_moments, std_from_moments

    path = data_path = Path(path).expanduser()
    inputs, outputs = list(inputs), list(outputs)
    rank, world = accelerator.process_index, accelerator.num_processes
    cap = min((c for c in (max_patterns, max_patterns_per_rank * world) if c), default=0)
    with contextlib.ExitStack() as files:
        sources = [Source("--data", path, files.enter_context(open_dataset(path)))]
        if atmos_path is not None:
            atmos_path = Path(atmos_path).expanduser()
            sources.append(Source("--data-atmos", atmos_path,
                                  files.enter_context(open_dataset(atmos_path, "--data-atmos"))))
        found, mask, lat = resolve_variables(
            sources,
            inputs,
            outputs,
            variables=variables,
            mask_variable=mask_variable,
            lat_variable=lat_variable,
            need_lat=min_abs_lat > 0 or hemisphere != "both",
            need_ice=not open_water,
        )
        ds = FieldView({name: source.ds[var] for name, (source, var) in found.items()}, dict(sources[0].ds.attrs))
        if len(sources) > 1:  # the messages below name both files
            path = f"{path} (with --data-atmos {atmos_path})"
        names = inputs + outputs
        selection = select_patterns(
            ds,
            path,
            names=names,
            mask_variable=mask,
            lat_variable=lat,
            min_abs_lat=min_abs_lat,
            thin=thin,
            max_patterns=cap,
            val_fraction=val_fraction,
            seed=seed,
            hemisphere=hemisphere,
            ice_variable="" if open_water else "aice",
        )
        shard = torch.from_numpy(read_shard(ds, path, names, selection.cells, rank, world))
        units = {name: str(ds[name].attrs.get("units", "")) for name in names}
        limits = {name: physical_range(name, units[name], range_factor) for name in names}
        attributes = {key: (value.item() if hasattr(value, "item") else value) for key, value in ds.attrs.items()}

    bad = counted_over_ranks(accelerator, (~torch.isfinite(shard)).sum(dim=0))
    for name, count in zip(names, bad, strict=True):
        if count:
            kind = "input" if name in inputs else "output"
            raise UsageError(
                f"--data {path}: {kind} field {name!r} has {count} NaN/inf values inside the "
                f"sea-ice domain ({len(selection.cells)} patterns); fill them or mask those cells "
                f"(--mask-variable) before training"
            )
    # netCDF's default fill value (9.97e36 for floats) is what a file holds where nothing was written; without a
    # _FillValue attribute nobody decodes it to NaN, and it would be trained on as a number.
    filled = counted_over_ranks(accelerator, never_written(shard).sum(dim=0))
    for name, count in zip(names, filled, strict=True):
        if count:
            raise UsageError(
                f"--data {path}: field {name!r} holds netCDF's default fill value (about 9.97e36) at {count} "
                "cells inside the sea-ice domain: those cells were never written; give the variable a _FillValue "
                "attribute (they become NaN) and mask them, or fill them"
            )
    outside = torch.zeros(len(names), dtype=torch.float64)
    for column, name in enumerate(names):
        if limits[name] is not None:
            low, high = limits[name]
            outside[column] = ((shard[:, column] < low) | (shard[:, column] > high)).sum()
    for name, count in zip(names, counted_over_ranks(accelerator, outside), strict=True):
        if count:
            low, high = limits[name]
            unit = units[name].strip() or f"no units attribute: the range of {name} in any of its usual units"
            raise UsageError(
                f"--data {path}: field {name!r} ({unit}) has {count} values outside {low:g} .. {high:g} "
                "inside the sea-ice domain: wrong units or a damaged file; if they are real, widen the physical "
                "ranges with --range-factor (0 turns the check off)"
            )
    if not selection.is_valid.any():
        raise UsageError(
            f"--data {path}: no validation patterns ({len(selection.cells)} patterns, --val-fraction "
            f"{val_fraction}); raise --val-fraction or --max-patterns, or lower --thin"
        )
    is_valid_mine = torch.from_numpy(selection.is_valid[rank::world])
    train_mine = shard[~is_valid_mine]
    if int((~torch.from_numpy(selection.is_valid)).sum()) == 0:
        raise UsageError(
            f"--data {path}: no training patterns left ({len(selection.cells)} patterns, "
            f"--val-fraction {val_fraction}); lower --val-fraction or --thin"
        )
    count, mean, m2 = merge_moments(accelerator, train_mine)
    std = std_from_moments(count, m2)
    raw_std = std_from_moments(count, m2, floor=0.0)
    for offset, name in enumerate(outputs):
        if raw_std[len(inputs) + offset] == 0:
            raise UsageError(
                f"--data {path}: output field {name!r} is {mean[len(inputs) + offset].item():g} at every training "
                "pattern: there is nothing to learn; check the file and the domain (--mask-variable, --min-abs-lat)"
            )
    full = gather_strided(accelerator, shard, len(selection.cells))
    is_valid = torch.from_numpy(selection.is_valid)
    n_in = len(inputs)
    train, valid = full[~is_valid], full[is_valid]
    meta = {
        "inputs": inputs,
        "outputs": outputs,
        "units": units,
        "grid": list(selection.grid_shape),
        "domain_cells": selection.domain_cells,
        "patterns": len(selection.cells),
        "train_patterns": len(train),
        "valid_patterns": len(valid),
        "attributes": attributes,
        "variables": {name: found[name][1] for name in names},
        "from_atmosphere": [name for name in names if found[name][0].flag == "--data-atmos"],
        "mask_variable": mask,
        "lat_variable": lat,
        "hemisphere": hemisphere,
        "open_water": open_water,
        "max_patterns": cap,
    }
    meta["fingerprint"] = patterns_fingerprint(data_path, atmos_path, meta, thin, max_patterns_per_rank)
    return UfsPatterns(
        train[:, :n_in],
        train[:, n_in:],
        valid[:, :n_in],
        valid[:, n_in:],
        mean[:n_in],
        std[:n_in],
        mean[n_in:],
        std[n_in:],
        meta,
    )


# ---- the generator -------------------------------------------------------------------------------------------

# name: (units, long name)
FIELDS = {
    "sst": ("K", "sea surface temperature"),
    "sss": ("psu", "sea surface salinity"),
    "tair": ("K", "air temperature at 2 m"),
    "tsfc": ("K", "snow/ice surface temperature"),
    "hi": ("m", "grid-cell mean ice thickness"),
    "hs": ("m", "grid-cell mean snow thickness"),
    "sice": ("psu", "bulk ice salinity"),
    "uocn": ("m/s", "ocean current (x)"),
    "vocn": ("m/s", "ocean current (y)"),
    "uatm": ("m/s", "wind velocity (x)"),
    "vatm": ("m/s", "wind velocity (y)"),
    "qref": ("kg/kg", "2 m reference specific humidity"),
    "flwdn": ("W/m^2", "downward longwave flux"),
    "fswdn": ("W/m^2", "downward shortwave flux"),
}
AICE_FORMULA = (
    "aice = sigmoid(2.5 tanh((271.85 - sst) / 1.5) + 1.5 tanh(hi - 0.5) - 0.06 (tair - 258.15) "
    "+ 0.5 tanh(0.1 (uatm + vatm)) - 0.003 (fswdn - 100) + 0.3 sin(4 hs)) + N(0, noise_sigma^2)"
)


def clean_aice(f: dict[str, np.ndarray]) -> np.ndarray:
    """The noise-free ice concentration of the generated files (AICE_FORMULA without the noise)."""
    z = (
        2.5 * np.tanh((271.85 - f["sst"]) / 1.5)
        + 1.5 * np.tanh(f["hi"] - 0.5)
        - 0.06 * (f["tair"] - 258.15)
        + 0.5 * np.tanh(0.1 * (f["uatm"] + f["vatm"]))
        - 0.003 * (f["fswdn"] - 100.0)
        + 0.3 * np.sin(4.0 * f["hs"])
    )
    return 1.0 / (1.0 + np.exp(-z))


def _smooth_fields(rng, lat, lon, count: int, modes: int = 6) -> np.ndarray:
    """`count` smooth random fields of unit scale on the grid (sums of random planar waves), plus a little
    per-cell noise so that neighbouring cells differ."""
    out = np.zeros((count, *lat.shape))
    phi, lam = np.deg2rad(lat), np.deg2rad(lon)
    for k in range(count):
        for _ in range(modes):
            m, n = rng.integers(1, 6), rng.integers(1, 6)
            out[k] += np.sin(m * phi * 2 + rng.uniform(0, 2 * np.pi)) * np.cos(n * lam + rng.uniform(0, 2 * np.pi))
        out[k] = out[k] / np.sqrt(modes / 4) + 0.3 * rng.standard_normal(lat.shape)
    return out


def synthesize(
    out: Path | str,
    seed: int = 0,
    nlat: int = 180,
    nlon: int = 360,
    sigma: float = 0.05,
    land_fraction: float = 0.25,
    *,
    naming: str = "ours",
    atmos_out: Path | str | None = None,
) -> Path:
    """Write a CICE-like netCDF file (dims time=1, nj, ni; TLAT/TLON/tmask) with the 14 input fields and aice.

    naming="cice": the fields carry the CICE history names (sst_h, Tair_h, Qref_h, aice_h, ...; the same values
    and units) and the file also holds the U-cell mask and coordinates (umask: a T cell whose east, north and
    north-east neighbours are ocean too; ULAT/ULON half a cell to the north-east). atmos_out: the atmospheric
    fields (ATMOSPHERE_FIELDS) go to that second file, on the same grid, with TLAT/TLON; the rest stay in `out`."""
    if naming not in ("ours", "cice"):
        raise UsageError(f"--naming {naming} is invalid; give ours or cice")
    xr = extras.xarray()
    from tqdm.auto import tqdm

    out = Path(out).expanduser()
    rng = np.random.default_rng(seed)
    lat1 = (np.arange(nlat) + 0.5) * 180.0 / nlat - 90.0
    lon1 = (np.arange(nlon) + 0.5) * 360.0 / nlon
    lat, lon = np.meshgrid(lat1, lon1, indexing="ij")
    s = _smooth_fields(rng, lat, lon, 15)
    polar = np.clip((np.abs(lat) - 40.0) / 50.0, 0.0, 1.0)  # 0 at 40 degrees, 1 at the poles
    f: dict[str, np.ndarray] = {}
    f["sst"] = np.maximum(271.35 + 10.0 * (1 - polar) ** 2 + 0.8 * s[0], 271.2)
    f["sss"] = 33.0 + 1.0 * s[1]
    f["tair"] = 280.0 - 30.0 * polar + 5.0 * s[2]
    f["tsfc"] = np.minimum(f["tair"] + 2.0 * s[3], 273.15)
    f["hi"] = 2.5 * polar * np.exp(0.4 * s[4])
    f["hs"] = 0.15 * f["hi"] * np.exp(0.3 * s[5])
    f["sice"] = np.clip(4.0 + 1.5 * s[6], 0.5, None)
    f["uocn"], f["vocn"] = 0.1 * s[7], 0.1 * s[8]
    f["uatm"], f["vatm"] = 6.0 * s[9], 6.0 * s[10]
    f["qref"] = 3.8e-3 * np.exp(0.07 * (f["tair"] - 273.15)) * (0.8 + 0.1 * s[11])
    f["flwdn"] = 0.7 * 5.67e-8 * f["tair"] ** 4 + 15.0 * s[12]
    f["fswdn"] = np.maximum(250.0 * (1 - 0.8 * polar) + 40.0 * s[13], 0.0)
    aice = clean_aice(f) + sigma * rng.standard_normal(lat.shape)
    ocean = s[14] > np.quantile(s[14], land_fraction)
    rename = (lambda name: CICE_NAMES.get(name, name)) if naming == "cice" else (lambda name: name)
    dims = ("time", "nj", "ni")
    ocean_vars, atmos_vars = {}, {}
    for name in tqdm([*FIELDS, "aice"], desc="fields", unit="field", leave=False):
        values = aice if name == "aice" else f[name]
        values = np.where(ocean, values, np.nan).astype(np.float32)[None]
        units, long_name = FIELDS.get(name, ("1", "ice area (aggregate)"))
        target = atmos_vars if atmos_out is not None and name in ATMOSPHERE_FIELDS else ocean_vars
        target[rename(name)] = xr.Variable(dims, values, {"units": units, "long_name": long_name})
    ocean_vars["tmask"] = xr.Variable(("nj", "ni"), ocean.astype(np.float32), {"long_name": "ocean grid mask"})
    coordinates = {
        "TLAT": xr.Variable(("nj", "ni"), lat.astype(np.float32), {"units": "degrees_north"}),
        "TLON": xr.Variable(("nj", "ni"), lon.astype(np.float32), {"units": "degrees_east"}),
    }
    if naming == "cice":
        corners = ocean & np.roll(ocean, -1, axis=1) & np.roll(ocean, -1, axis=0) & np.roll(ocean, (-1, -1), (0, 1))
        corners[-1] = False  # no row north of the last one
        ocean_vars["umask"] = xr.Variable(("nj", "ni"), corners.astype(np.float32), {"long_name": "U-cell mask"})
        coordinates["ULAT"] = xr.Variable(("nj", "ni"), (lat + 90.0 / nlat).astype(np.float32),
                                          {"units": "degrees_north"})
        coordinates["ULON"] = xr.Variable(("nj", "ni"), (lon + 180.0 / nlon).astype(np.float32),
                                          {"units": "degrees_east"})
    ocean_vars.update(coordinates)
    attributes = {
        "title": "synthetic GDAS-like CICE/MOM6 fields for the UFS sea-ice emulator",
        "noise_sigma": float(sigma),
        "aice_formula": AICE_FORMULA,
        "seed": int(seed),
        "generator": "python -m toolkit.data.ufs synth",
    }
    time = {"time": ("time", np.array([0.0]), {"units": "days since 2021-01-01"})}
    files = [(Path(out).expanduser(), ocean_vars)]
    if atmos_out is not None:
        atmos_vars.update({name: coordinates[name] for name in ("TLAT", "TLON")})
        files.append((Path(atmos_out).expanduser(), atmos_vars))
    for path, variables in files:
        ds = xr.Dataset(variables, coords=time)
        ds.attrs.update(attributes)
        encoding = {name: {"_FillValue": np.float32(1e30)} for name in variables if ds[name].ndim == 3}  # fields
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        ds.to_netcdf(partial, engine="netcdf4", encoding=encoding)
        partial.replace(path)  # a reader never sees half a file
    return out


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toolkit.data.ufs", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    synth = commands.add_parser("synth", help="write a GDAS-like netCDF file with a known noise floor")
    synth.add_argument("--out", type=Path, required=True, help="netCDF file to write")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--nlat", type=int, default=180, help="grid rows (latitudes)")
    synth.add_argument("--nlon", type=int, default=360, help="grid columns (longitudes)")
    synth.add_argument("--sigma", type=float, default=0.05, help="standard deviation of the noise added to aice")
    synth.add_argument("--naming", default="ours", help="variable names: ours (sst, aice, ...) or cice (sst_h, ...)")
    synth.add_argument("--atmos-out", type=Path, help="write the atmospheric fields to this second file")
    args = parser.parse_args(argv)
    if args.nlat < 2 or args.nlon < 2:
        raise UsageError(f"--nlat {args.nlat} / --nlon {args.nlon}: the grid needs at least 2 x 2 cells")
    if not (args.sigma >= 0 and math.isfinite(args.sigma)):
        raise UsageError(f"--sigma {args.sigma} is invalid; give a finite standard deviation >= 0")
    if args.naming not in ("ours", "cice"):
        raise UsageError(f"--naming {args.naming} is invalid; give ours (sst, aice, ...) or cice (sst_h, aice_h, ...)")
    for flag, value in (("--out", args.out), ("--atmos-out", args.atmos_out)):
        if value is not None and value.is_dir():
            raise UsageError(f"{flag} {value} is a directory; give a file name, e.g. {value}/gdas-like.nc")
    if args.atmos_out is not None and args.atmos_out.expanduser().resolve() == args.out.expanduser().resolve():
        raise UsageError(f"--atmos-out {args.atmos_out} is the --out file; give the atmosphere its own file")
    path = synthesize(args.out, seed=args.seed, nlat=args.nlat, nlon=args.nlon, sigma=args.sigma, naming=args.naming,
                      atmos_out=args.atmos_out)
    where = f" ({', '.join(ATMOSPHERE_FIELDS)} in {args.atmos_out})" if args.atmos_out else ""
    print(f"wrote {path}: {args.nlat} x {args.nlon} grid, 14 inputs and aice{where} (noise sigma {args.sigma}, "
          f"{args.naming} names)")


if __name__ == "__main__":
    main()
