"""UFS sea-ice emulator data: patterns (one grid cell = one pattern) from CICE/MOM6-style netCDF files.

    python -m toolkit.data.ufs synth --out data/gdas-like.nc [--seed 0] [--nlat 180] [--nlon 360] [--sigma 0.05]
    python -m toolkit.data.ufs synth --out ocean.nc --atmos-out atmos.nc --naming cice   # CICE history names, 2 files
    python -m toolkit.data.ufs synth --out ocean.nc --atmos-out atmos.nc --layout gaussian-cf   # aibalance's CF pair

Reading (xarray, netCDF4 engine): the input and output variables are chosen by our names (default: the 14 -> aice
set of the reference emulator); each is looked up in the file(s) under, in order, an explicit name (`variables`,
the recipe's --variables NAME=VAR), our name, the CICE history name (`sst_h`, `Tair_h`, `Qref_h`, `aice_h`, ...),
and its CF standard names (a variable of that name, or one whose `standard_name` attribute is it); the names found
are reported in one line (`describe_variables`). The inputs may come from two files on the same grid (ocean/ice
`--data` and atmosphere `--data-atmos`). A field may carry leading length-1 dimensions (CICE history files have
`time`). aibalance's current CF files (a Gaussian grid, 1-D latitude/longitude, ocean fields (lat, lon, lev)) are
read as ufs_cf describes: the surface level, the axes broadcast, the pair matched by coordinate value.

The patterns are the cells of the sea-ice domain, selected as `--domain` says (ufs_domains: toolkit, soca,
soca-unclean, aibalance-c710abb, aibalance-b1eccbc; a team's domain is its code's rule and cap, and its reader's
inputs: aibalance-b1eccbc's reader reads no sice, uocn, vocn, flwdn or fswdn and gives them 0, and so do we,
whatever the files hold, said in one line). Ours (toolkit): ocean (the mask
variable, `tmask` or `umask`, "auto" tries those; or `--mask thickness-tair`, aibalance's), poleward of
`--min-abs-lat` in one hemisphere or both (from the latitude variable, `TLAT` with tmask, `ULAT` with umask),
optionally without open water (aice > 0 only); thinned to every `--thin`-th cell, capped at `--max-patterns`
cells, or at `--max-patterns-per-rank` x the process count (a keyed random subset, the same whatever the process
count) and split into training and validation by a keyed coin per cell.

Sharding as seed 001 does it: rank r of W reads only the values of patterns r, r+W, r+2W, ... . The normalisation
statistics are merged from those shards (count, mean, M2 in float64: toolkit.run.distributed.merge_moments); the
shards are then assembled in pattern order on every rank, so the training set, and with it the training, does not
depend on how the patterns were sharded.

Dimensions are matched by name, never by position: a field stored as (ni, nj) beside fields stored as (nj, ni) is
read transposed back (`by_name`); one whose dimension names share nothing with the first field's is refused on a
square grid, where sizes cannot tell rows from columns. The cells are numbered in one order, rows then columns
((nj, ni), (lat, lon): `canonical`, by dimension name, or by a Gaussian file's 1-D latitude and longitude), whatever
the order a file stores them in: the same data stored (ni, nj) gives the same patterns in the same order, and the
same run.

Bad input is one UsageError line naming the file and what is wrong: a missing or unreadable file, a missing
variable (with the names tried), two variables in one file for one input (naming both), two files on different
grids, a field that is not 2-D, an all-masked domain, latitudes NaN/inf or outside -90 .. 90 in the masked cells
(with their count and the first cell), NaNs in a field inside the domain (with their count), values outside the
physical range of the field's units (with no units attribute: of what its name names, in any of its usual units).

The generator writes such a file: the 14 fields on a lat/lon grid with plausible ranges and units (land cells are
fill values, as in model output), and aice = sigmoid(f(inputs)) + Gaussian noise of standard deviation sigma, with
f a known smooth function (`clean_aice`); sigma is in the file's attributes (`noise_sigma`), so the best
achievable validation RMSE is known. With naming="cice" the variables carry the CICE history names (plus `umask`,
`ULAT`, `ULON`, and the other fields aibalance c710abb's reader reads: frzmlt_h, strocnx_h, strocny_h, strairx_h,
strairy_h); with an atmosphere file the atmospheric fields go there. layout="gaussian-cf" writes aibalance's
pair instead (ufs_cf.write_gaussian_cf).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolkit.data.cache import file_fingerprint
from toolkit.data.prepared import counted_over_ranks
from toolkit.data.rows import TensorRows
from toolkit.data.ufs_cf import (
    AIBALANCE_CF,
    CF_ATMOSPHERE,
    LON_FOR_LAT,
    Level,
    alignment,
    at_surface,
    broadcast_axis,
    describe_levels,
    file_axes,
    gaussian_latitudes,
    write_gaussian_cf,
)
from toolkit.data.ufs_domains import (
    AUTO,
    DOMAINS,
    THICKNESS_TAIR,
    TOOLKIT,
    cap_cells,
    check_domain,
    depends_on_world,
    describe_zeroed,
    domain_rule,
    mask_kind,
    team_ice,
    team_latitude,
    thickness_tair_ocean,
    zeroed_inputs,
)
from toolkit.errors import UsageError
from toolkit.process import extras
from toolkit.process.entry import one_line_errors
from toolkit.run.randomness import keyed_uniform

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
VALIDATION_COIN = 11  # the purpose of the keyed per-cell validation coin (the cap's: ufs_domains.CAP_COIN)

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
    # what aibalance c710abb's reader also reads (its var_names; a file without them is a KeyError there)
    "frzmlt": "frzmlt_h",
    "strocnx": "strocnx_h",
    "strocny": "strocny_h",
    "strairx": "strairx_h",
    "strairy": "strairy_h",
}
# The second name of sst, sss, tsfc, hs, uocn, vocn, qref (and thick, the ocean's top-layer thickness) is the one
# aibalance's CF files use (b1eccbc cf_mappings.py: ufs_cf.AIBALANCE_CF).
CF_NAMES = {
    "sst": ("sea_surface_temperature", "sea_water_potential_temperature"),
    "sss": ("sea_surface_salinity", "sea_water_salinity"),
    "tair": ("air_temperature",),
    "tsfc": ("sea_ice_surface_temperature", "surface_temperature", "skin_temperature_at_surface"),
    "hi": ("sea_ice_thickness",),
    "hs": ("surface_snow_thickness", "sea_ice_snow_thickness"),
    "sice": ("sea_ice_salinity",),
    "uocn": ("sea_water_x_velocity", "eastward_sea_water_velocity"),
    "vocn": ("sea_water_y_velocity", "northward_sea_water_velocity"),
    "uatm": ("x_wind", "eastward_wind"),
    "vatm": ("y_wind", "northward_wind"),
    "qref": ("specific_humidity", "water_vapor_mixing_ratio_wrt_moist_air"),
    "flwdn": ("surface_downwelling_longwave_flux_in_air",),
    "fswdn": ("surface_downwelling_shortwave_flux_in_air",),
    "aice": ("sea_ice_area_fraction",),
    "thick": ("sea_water_cell_thickness",),
    "lat": ("latitude",),
    "lon": ("longitude",),
}
MASK_NAMES = DOMAINS["toolkit"].mask_names  # CICE's T-cell and U-cell (velocity point) ocean masks
LAT_FOR_MASK = {"tmask": "TLAT", "umask": "ULAT"}  # each mask's latitudes (CICE's staggered grid)
LAT_NAMES = ("TLAT", "ULAT", "lat", "latitude")
HEMISPHERES = ("both", "north", "south")
ATMOSPHERE_FIELDS = ("tair", "uatm", "vatm", "qref", "flwdn", "fswdn")  # what the generator's --atmos-out holds
LAYOUTS = ("cice", "gaussian-cf")  # the generator's: CICE history (time, nj, ni); aibalance's CF pair (ufs_cf)


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


def grid_field(ds, name: str, path: Path | str, like: tuple | None = None, variable: str | None = None):
    """The variable as a 2-D (y, x) DataArray: leading length-1 dimensions (time) are dropped. With `like` (the first
    field: (its name, its 2-D DataArray)) its dimensions are matched to that field's BY NAME, never by position.
    `variable`: its name in the file, for the messages (default `name`)."""
    array = ds[name]
    shown = variable or name
    while array.ndim > 2 and array.shape[0] == 1:
        array = array.isel({array.dims[0]: 0})
    if array.ndim != 2:
        raise UsageError(
            f"--data {path}: variable {shown!r} has dimensions {dict(array.sizes)}; expected a 2-D "
            "grid field (leading length-1 dimensions such as time are allowed), or (y, x, level) on a grid that "
            "the file's latitude/longitude variables name"
        )
    return canonical(array) if like is None else by_name(array, shown, *like, path)


# The grid's dimension names by what they index: rows (latitude-like, y) and columns (longitude-like, x). CICE's
# nj/ni, CF's lat/lon, MOM6's yh/xh and yq/xq, FV3's grid_yt/grid_xt, POP's nlat/nlon, and plain y/x, j/i.
ROW_DIMS = frozenset({"nj", "j", "y", "lat", "latitude", "yh", "yq", "yt", "grid_yt", "nlat", "rlat", "south_north"})
COLUMN_DIMS = frozenset({"ni", "i", "x", "lon", "longitude", "xh", "xq", "xt", "grid_xt", "nlon", "rlon", "west_east"})


def canonical(array):
    """A 2-D field in the one cell order the patterns are numbered in, rows then columns ((nj, ni), (lat, lon)),
    whatever the order it is stored in: transposed when its dimension names say it is stored (columns, rows). The
    first field's order is every other field's (by_name), so a file stored (ni, nj) throughout gives the patterns,
    their order, the validation coin and the cap of the file stored (nj, ni). Names that say neither are taken as
    stored."""
    if array.ndim != 2:
        return array
    first, second = (str(d).lower() for d in array.dims)
    turned = first in COLUMN_DIMS or second in ROW_DIMS
    straight = first in ROW_DIMS or second in COLUMN_DIMS
    return array.transpose(*array.dims[::-1]) if turned and not straight else array


def by_name(array, name: str, like_name: str, like, path: Path | str):
    """`array` (2-D) with its dimensions in like's order, matched by name: a field stored as (ni, nj) beside fields
    stored as (nj, ni) is read transposed back, never row for column. With one name in common, that name fixes the
    order. With none, only sizes could tell, and only on a grid that is not square: there the array is taken as it
    is, or transposed when its shape is like's reversed (another shape is refused by the caller's grid check); on a
    square grid it is refused."""
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
    return array.transpose(*array.dims[::-1]) if array.shape[::-1] == like.shape else array


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
    domain: str = TOOLKIT,
    mask: str = "variable",
    zeroed=(),
    optional=(),
) -> tuple[dict[str, tuple[Source, str]], str, str]:
    """Find every field, the mask and the latitudes: ({our name or the mask/latitude name: (file, name there)},
    mask key ("" = none), latitude key ("" = not needed)). A name not found is one error naming the names tried.
    `domain` decides what "auto" tries (the team's own names) and what its selection reads (SOCA's latitudes, the
    teams' aice); mask "thickness-tair" reads thick and tair instead of a mask variable, a team's "none" no mask.
    `zeroed` inputs are not looked for (the domain's reader gives them as 0: ufs_domains.zeroed_inputs), `optional`
    names are taken where a file holds them (predict's truth) and left out where none does."""
    rule = domain_rule(domain)
    kind = mask_kind(domain, mask)
    thickness_tair = kind == "thickness-tair"
    found: dict[str, tuple[Source, str]] = {}
    wanted = [(name, "input") for name in inputs if name not in zeroed] + [(name, "output") for name in outputs]
    needs = ([("aice", "ice fraction (for open water left out)")] if need_ice else []) + (
        [("aice", f"ice fraction (--domain {domain}'s selection)")] if domain != TOOLKIT and rule.ice else []) + (
        [("thick", f"ocean cell thickness (--mask thickness-tair: {THICKNESS_TAIR})"),
         ("tair", f"air temperature (--mask thickness-tair: {THICKNESS_TAIR})")] if thickness_tair else [])
    for name, what in needs:
        if name not in dict(wanted):  # read for the selection (a zeroed input too: the selection sees the file's)
            wanted.append((name, what))
    wanted += [(name, "optional") for name in optional if name not in dict(wanted)]
    for name, what in wanted:
        tried = candidate_names(name, variables)
        standard = () if variables and name in variables else CF_NAMES.get(name, ())
        hit = find_variable(sources, tried, standard)
        if hit is None and what == "optional":
            continue
        if hit is None:
            raise _missing(sources, tried[0], what, tried, standard=bool(standard))
        if not (variables and name in variables):  # an explicit name is the user's choice
            ambiguous = ambiguity(hit[0], name, what, tried, standard)
            if ambiguous is not None:
                raise ambiguous
        found[name] = hit
    mask_key = ""
    if mask_variable and kind == "variable":
        tried = list(rule.mask_names) if mask_variable == AUTO else [mask_variable]
        hit = find_variable(sources, tried)
        if hit is None:
            cf = any(AIBALANCE_CF["thick"] in s.ds.variables for s in sources) and domain == TOOLKIT
            hint = (" (a CF file: --mask thickness-tair draws aibalance's ocean from sea_water_cell_thickness and "
                    "tair)" if cf else ' (--mask-variable NAME; "" for every cell)')
            raise _missing(sources, tried[0], "mask", tried, hint)
        mask_key = hit[1]
        found[mask_key] = hit
    lat = ""
    if need_lat or rule.pole:
        if lat_variable == AUTO and rule.lat_names is not None:
            tried = list(rule.lat_names)
            hit = find_variable(sources, tried)
        elif lat_variable == AUTO:
            paired = LAT_FOR_MASK.get(mask_key)
            tried = [*([paired] if paired else []), *[n for n in LAT_NAMES if n != paired]]
            hit = find_variable(sources, tried, CF_NAMES["lat"])
        else:
            tried = [lat_variable]
            hit = find_variable(sources, tried)
        if hit is None:
            hint = (" (--lat-variable NAME)" if domain != TOOLKIT else
                    " (--lat-variable NAME; or --min-abs-lat 0 and --hemisphere both)")
            raise _missing(sources, tried[0], "latitude", tried, hint,
                           standard=lat_variable == AUTO and rule.lat_names is None)
        lat = hit[1]
        found[lat] = hit
    fields = {name: hit for name, hit in found.items() if name not in (mask_key, lat)}
    if len(sources) > 1 and all(source is sources[0] for source, _ in fields.values()):
        raise UsageError(
            f"{sources[1].flag} {sources[1].path}: no field was taken from it: {sources[0].flag} {sources[0].path} "
            f"(searched first) holds all of {', '.join(fields)}; leave {sources[1].flag} out"
        )
    return found, mask_key, lat


def field_view(sources: list[Source], found: dict[str, tuple[Source, str]], mask: str = "",
               lat: str = "", others=()) -> tuple[FieldView, dict[str, Level], str]:
    """The found variables as 2-D fields on one grid, keyed as `found` is: leading length-1 dimensions dropped, a
    trailing level dimension read at the file's surface level (ufs_cf.at_surface), a Gaussian file's 1-D latitude or
    longitude broadcast to its grid, the two files checked to share one grid and, both Gaussian, the atmosphere's
    fields matched to the ocean's cells by coordinate value. Returns (the view, {key: Level} for the fields read at
    a level, a line saying what the matching reordered, or "")."""
    axes = {source.flag: file_axes(source) for source in sources}
    grids = [a.dims for a in axes.values() if a is not None]
    arrays, levels = {}, {}
    for key, (source, var) in found.items():
        own = axes[source.flag]
        if own is not None and own.gaussian and var in (own.lat, own.lon):
            arrays[key] = broadcast_axis(source, own, var)
            continue
        arrays[key], level = at_surface(source.ds[var], var, source, grids)
        if level is not None:
            levels[key] = level
        if own is not None and own.gaussian and arrays[key].ndim == 2 and set(map(str, arrays[key].dims)) == set(
                own.dims):  # 1-D latitude and longitude name the rows and the columns whatever the dimension names
            arrays[key] = arrays[key].transpose(*own.dims)
    gaussian_pair = len(sources) > 1 and all(a is not None and a.gaussian for a in axes.values())
    if gaussian_pair:  # the atmosphere's grid dimensions under the ocean's names: its fields are matched by them
        reference, other = sources
        rename = {own: ref for own, ref in zip(axes[other.flag].dims, axes[reference.flag].dims, strict=True)
                  if own != ref}
        for key, (source, _) in found.items():
            if source is other and rename:
                arrays[key] = arrays[key].rename(rename)
    view = FieldView(arrays, dict(sources[0].ds.attrs))
    fields = {key: hit for key, hit in found.items() if key not in (mask, lat, *others)}
    check_same_grid(sources, fields, view)
    line = ""
    if gaussian_pair:
        take, line = alignment(reference, axes[reference.flag], other, axes[other.flag])
        for key, (source, _) in found.items():
            if source is other and take:
                arrays[key] = arrays[key].isel(take)
    return view, levels, line


def check_same_grid(sources: list[Source], found: dict[str, tuple[Source, str]], view) -> None:
    """Two files must hold their fields on one grid: the first field of each decides (one error naming both; the
    second's dimensions matched to the first's by name). `view` holds the fields as read (at their level)."""
    first: dict[str, tuple[str, str]] = {}
    for key, (source, var) in found.items():
        if source.flag not in first:
            first[source.flag] = (key, var)
    if len(first) < 2:
        return
    (a, (key_a, var_a)), (b, (key_b, var_b)) = first.items()
    path = {s.flag: s.path for s in sources}
    array_a = grid_field(view, key_a, path[a], variable=var_a)
    both = f"{path[a]} (with {b} {path[b]})"
    shape_a = tuple(array_a.shape)
    shape_b = tuple(grid_field(view, key_b, both, like=(var_a, array_a), variable=var_b).shape)
    if shape_a != shape_b:
        raise UsageError(
            f"{a} {path[a]} and {b} {path[b]} are on different grids: {var_a!r} is {shape_a} in the first, "
            f"{var_b!r} is {shape_b} in the second; the ocean and atmosphere files must share one grid"
        )


def describe_variables(meta: dict) -> str:
    """One line: our name <- the name found, for every field, the mask and the latitudes (the teams' files use
    CICE history names; this says which were taken)."""
    names, zeroed = meta["variables"], meta.get("zeroed") or []
    parts = [f"{name}<-{'0' if name in zeroed else names[name]}" for name in [*meta["inputs"], *meta["outputs"]]]
    parts += [f"{name}<-{variable}" for name, variable in (meta.get("selection_variables") or {}).items()]
    parts += [f"{what}<-{meta[key]}" for what, key in (("mask", "mask_variable"), ("lat", "lat_variable"))
              if meta.get(key)]
    atmosphere = meta.get("from_atmosphere") or []
    tail = f"; from --data-atmos: {', '.join(atmosphere)}" if atmosphere else ""
    return f"variables: {', '.join(parts)}{tail}"


def describe_layout(meta: dict) -> list[str]:
    """The lines that say how the files were read and which cells are patterns: first the inputs given as 0 (the
    domain's reader reads none of them), then the level taken of fields with a level dimension, the atmosphere's
    cells matched to the ocean's by coordinate value, and the domain's rule."""
    zeroed = describe_zeroed(meta.get("domain", TOOLKIT), meta.get("zeroed") or [])
    lines = [line for line in (zeroed, *(meta.get(key) for key in ("levels", "reordered"))) if line]
    if meta.get("where"):
        lines.append(f"domain ({meta.get('domain', TOOLKIT)}): {meta['where']}")
    return lines


@dataclass
class Selection:
    """The patterns: flat cell numbers of the grid (ascending) and which of them are validation patterns."""

    cells: np.ndarray
    is_valid: np.ndarray
    grid_shape: tuple[int, int]
    domain_cells: int  # cells in the sea-ice domain before thinning and capping
    domain: str = TOOLKIT  # whose selection (--domain)
    where: str = ""  # the domain's cells in words, e.g. "umask == 1 and ULAT > 40 and 0 < aice <= 1"
    depends_on_world: bool = False  # the cap depends on the process count (SOCA's per rank, --max-patterns-per-rank)


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
    "N/m^2": (-50.0, 50.0),  # CICE's stresses (strairx_h, strocnx_h, ...)
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
    "frzmlt": (-1000.0, 1000.0),
    "strocnx": (-50.0, 50.0),
    "strocny": (-50.0, 50.0),
    "strairx": (-50.0, 50.0),
    "strairy": (-50.0, 50.0),
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
    domain: str = TOOLKIT,
    mask: str = "variable",
    max_patterns_per_rank: int = 0,
    world: int = 1,
) -> Selection:
    """The domain's cells as `domain` selects them (ufs_domains), every `thin`-th, capped as the domain caps, with a
    keyed validation coin per cell. Reads only the mask, latitude, ice (and thick/tair) fields; identical on every
    rank. --domain toolkit: ocean (mask "variable": `mask_variable` > 0.5; "thickness-tair": ufs_domains'), |lat| >=
    min_abs_lat in the `hemisphere` (north, south or both), with `ice_variable` only cells where it is > 0 (open
    water left out); at most `max_patterns` (or `max_patterns_per_rank` x `world`, the smaller), a keyed subset. A
    team's domain: its own comparisons and cap (mask_variable == 1; SOCA: lat beyond 40 in the hemisphere, 0 < aice
    <= 1, the first `max_patterns_per_rank` of each of `world` ranks' strides; with clean data: false (soca-unclean)
    lat beyond 60 alone, no mask, no ice condition; aibalance: its ice condition, the first `max_patterns` in grid
    order); `ice_variable` defaults to "aice" there (for a team with an ice condition)."""
    rule = domain_rule(domain)
    kind = mask_kind(domain, mask)
    if hemisphere not in HEMISPHERES:
        raise UsageError(f"--hemisphere {hemisphere} is invalid; give one of {', '.join(HEMISPHERES)}")
    team = domain != TOOLKIT
    if team:
        ice_variable = (ice_variable or "aice") if rule.ice else ""
    first = (names[0], grid_field(ds, names[0], path))  # every other field's dimensions are matched to its by name
    shape = first[1].shape
    for name in names:
        kind_of = grid_field(ds, name, path).dtype.kind
        if kind_of not in "fiub":
            raise UsageError(f"--data {path}: variable {name!r} holds {grid_field(ds, name, path).dtype} values, not "
                             "numbers; every input and output must be a numeric field")
    for name in names[1:]:
        if grid_field(ds, name, path, like=first).shape != shape:
            raise UsageError(
                f"--data {path}: variable {name!r} has grid {grid_field(ds, name, path, like=first).shape}, "
                f"{names[0]!r} has {shape}; every field must be on the same grid"
            )

    def on_grid(name: str, what: str, hint: str = "") -> np.ndarray:
        """A field the selection reads, on the fields' grid, as stored (a team compares the stored values)."""
        require_variables(ds, path, [name], f"{what}{f' ({hint})' if hint else ''}")
        array = grid_field(ds, name, path, like=first)
        if array.shape != shape:
            raise UsageError(f"--data {path}: {what} {name!r} has grid {array.shape}, the fields {shape}; it must be "
                             "on the fields' grid")
        if array.dtype.kind not in "fiub":
            raise UsageError(f"--data {path}: {what} {name!r} holds {array.dtype} values; it must hold numbers")
        return np.asarray(array.values)

    domain_grid = np.ones(shape, dtype=bool)
    where: list[str] = []
    if kind == "thickness-tair":
        domain_grid &= thickness_tair_ocean(on_grid("thick", "ocean cell thickness", "--mask thickness-tair"),
                                            on_grid("tair", "air temperature", "--mask thickness-tair"))
        where.append(THICKNESS_TAIR)
    elif mask_variable and kind == "variable":
        values = on_grid(mask_variable, "mask", '--mask-variable; "" for none')
        if team:
            domain_grid &= values == 1
            where.append(f"{mask_variable} == 1")
        else:
            domain_grid &= np.nan_to_num(np.asarray(values, dtype=np.float64)) > 0.5
            where.append(f"{mask_variable} > 0.5")
    bounded = rule.pole if team else (min_abs_lat > 0 or hemisphere != "both")
    if bounded:
        stored = on_grid(lat_variable, "latitude", "--lat-variable" if team else "--lat-variable; or --min-abs-lat 0")
        if stored.dtype.kind not in "fiu":
            raise UsageError(f"--data {path}: latitude {lat_variable!r} holds {stored.dtype} values; latitudes are "
                             "degrees north (numbers)")
        lat = np.asarray(stored, dtype=np.float64)
        # A NaN/inf latitude in a cell the mask keeps would fail every bound and drop the cell without a word.
        unknown = domain_grid & ~np.isfinite(lat)
        if unknown.any():
            at = np.unravel_index(int(np.flatnonzero(unknown.ravel())[0]), shape)
            index = ", ".join(f"{dim}={i}" for dim, i in zip(first[1].dims, at, strict=True))
            kept = "the cells the mask keeps" if len(where) else "the grid's cells (no mask)"
            raise UsageError(
                f"--data {path}: latitude {lat_variable!r} is NaN/inf at {int(unknown.sum())} of {kept} (e.g. "
                f"{index}: {lat[at]:g}); latitudes there must be finite degrees north, -90 .. 90: fill them, mask "
                "those cells, or name the latitude variable with --lat-variable"
            )
        off_earth = domain_grid & (np.abs(lat) > 90)  # the cells the mask keeps (land: fill)
        if off_earth.any():
            raise UsageError(
                f"--data {path}: latitude {lat_variable!r} has {int(off_earth.sum())} values outside -90 .. 90 "
                f"(e.g. {lat[off_earth][0]:g}) in the cells the mask keeps; latitudes are degrees north: check the "
                "file, or name the latitude variable with --lat-variable"
            )
        if team:  # SOCA: lat > 40.0 (north), lat < -40.0 (south), on the stored values; 60 with clean data: false
            keep, words = team_latitude(domain, hemisphere, stored, lat_variable)
            domain_grid &= keep
            where.append(words)
        else:
            lat = np.nan_to_num(lat)
            poleward = {"both": np.abs(lat), "north": lat, "south": -lat}[hemisphere]
            domain_grid &= poleward >= min_abs_lat
            where.append({"both": f"|{lat_variable}| >= {min_abs_lat}", "north": f"{lat_variable} >= {min_abs_lat}",
                          "south": f"{lat_variable} <= {-min_abs_lat:g}"}[hemisphere])
    if ice_variable:
        ice = on_grid(ice_variable, "ice fraction")
        if team:
            keep, words = team_ice(domain, ice)
            domain_grid &= keep
            where.append(words.replace("aice", ice_variable))
        else:
            domain_grid &= np.nan_to_num(np.asarray(ice, dtype=np.float64)) > 0
            where.append(f"{ice_variable} > 0")
    cells = np.flatnonzero(domain_grid.ravel())
    domain_cells = len(cells)
    if domain_cells == 0:
        check = ("--domain / --hemisphere / the file" if team else
                 "--mask-variable / --min-abs-lat / --hemisphere / --no-open-water")
        raise UsageError(
            f"--data {path}: the sea-ice domain is empty: no cell has {' and '.join(where) or 'data'}; "
            f"check {check}"
        )
    cells = cap_cells(domain, cells[::thin], max_patterns=max_patterns, max_patterns_per_rank=max_patterns_per_rank,
                      world=world, seed=seed)
    if len(cells) == 0:  # SOCA's MPI_MIN over ranks whose strides hold no domain cell
        raise UsageError(
            f"--data {path}: --domain {domain} on {world} processes leaves no pattern: a rank's stride (cells r, "
            f"r + {world}, ...) holds no domain cell and every rank keeps the smallest count; use fewer processes"
        )
    is_valid = keyed_uniform(seed, VALIDATION_COIN, 0, torch.from_numpy(cells)).numpy() < val_fraction
    return Selection(cells, is_valid, tuple(shape), domain_cells, domain, " and ".join(where),
                     depends_on_world(domain, max_patterns_per_rank))


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
                         max_patterns_per_rank: int, depends_on_world: bool | None = None) -> str:
    """What the patterns are made from: the content of both files (either changing changes the data) and, when a cap
    that depends on the process count cut the domain (--max-patterns-per-rank; SOCA's per rank), the number taken
    (another process count is another subset, which a resume must refuse), and the inputs given as 0 (zeroed). The
    selection flags themselves are config.json's, compared on resume."""
    fingerprint = file_fingerprint(path, FORMAT_VERSION)
    if atmos_path is not None:
        fingerprint += "+" + file_fingerprint(atmos_path, FORMAT_VERSION)
    per_world = bool(max_patterns_per_rank) if depends_on_world is None else depends_on_world
    if per_world and meta["patterns"] < math.ceil(meta["domain_cells"] / thin):
        fingerprint += f"/{meta['patterns']}"
    if meta.get("zeroed"):  # the same files give other patterns when inputs are 0 (a run from before: refused)
        fingerprint += f"/zeroed={','.join(meta['zeroed'])}"
    return fingerprint


def find_coordinates(sources: list[Source], lat_variable: str | None = None,
                     lon_variable: str | None = None) -> tuple[tuple[Source, str], tuple[Source, str]] | None:
    """The latitude and longitude of the grid's cells, for predict's output and maps: `lat_variable` (--lat-variable)
    where given, else the first file's own (ufs_cf.file_axes: TLAT, ULAT, lat, latitude or standard_name latitude;
    --data before --data-atmos); `lon_variable` where given, else the latitude's partner (TLAT: TLON, ULAT: ULON,
    lat: lon, latitude: longitude) in the latitude's file, else that file's own longitude. None when no file has a
    latitude and none was named; a named variable missing, or a latitude without a longitude, is one line."""
    def named(name: str, flag: str, what: str) -> tuple[Source, str]:
        hit = find_variable(sources, [name])
        if hit is None:
            files = " and ".join(f"{s.flag} {s.path}" for s in sources)
            have = ", ".join(sorted({str(v) for s in sources for v in s.ds.variables})[:30])
            raise UsageError(f"{flag} {name}: {files} {'have' if len(sources) > 1 else 'has'} no {what} variable "
                             f"{name!r}; the file{'s have' if len(sources) > 1 else ' has'}: {have}")
        return hit

    if lat_variable:
        lat = named(lat_variable, "--lat-variable", "latitude")
    else:
        axes = next(((source, a) for source in sources if (a := file_axes(source)) is not None), None)
        if axes is None:
            return None
        lat = (axes[0], axes[1].lat)
    if lon_variable:
        return lat, named(lon_variable, "--lon-variable", "longitude")
    source, name = lat
    partner = LON_FOR_LAT.get(name) or name.replace("LAT", "LON").replace("lat", "lon")
    if partner != name and partner in source.ds.variables:
        return lat, (source, partner)
    own = file_axes(source)
    if own is not None and own.lon is not None:
        return lat, (source, own.lon)
    raise UsageError(f"{source.flag} {source.path}: latitude {name!r} has no longitude beside it ({partner!r} is not "
                     "there); name it with --lon-variable")


@dataclass
class Fields:
    """What open_fields found: the view (keys: our names, the mask's, the latitude's and the coordinates' names),
    {key: (file, name there)}, the mask and latitude keys ("" = none), the levels read, the line on a reordered
    atmosphere, the label of the file(s) for messages, the inputs given as 0 (zeroed), the coordinates' keys (("",
    "") when not asked for or none found), whether they were 1-D axes (a Gaussian grid), and the fields' leading
    length-1 dimension: (its name, its coordinate variable or None), or None."""

    view: FieldView
    found: dict
    mask_key: str
    lat: str
    levels: dict
    reordered: str
    label: str
    zeroed: list = field(default_factory=list)
    coordinates: tuple[str, str] = ("", "")
    axes_1d: bool = False
    time: tuple | None = None


def zero_fields(view: FieldView, zeroed, like: str, path) -> None:
    """Each of `zeroed` as a field of zeros on the grid of view[like] (float32, no units): what a reader that reads
    none of them hands the training (aibalance b1eccbc's filter_data)."""
    xr = extras.xarray()
    grid = grid_field(view, like, path)
    for name in zeroed:
        view.variables[name] = xr.DataArray(np.zeros(grid.shape, dtype=np.float32), dims=grid.dims, attrs={
            "long_name": f"{name}: 0 at every cell (the domain's reader reads no {name})"})


def leading_time(found: dict, first: str) -> tuple | None:
    """The first field's leading length-1 dimension as stored (CICE's time), read now: (its name, its coordinate
    variable or None), or None when it has none."""
    xr = extras.xarray()
    source, var = found[first]
    stored = source.ds[var]
    if stored.ndim < 3 or stored.shape[0] != 1:
        return None
    dim = str(stored.dims[0])
    if dim not in source.ds.variables:
        return dim, None
    stamp = source.ds[dim].variable
    return dim, xr.Variable(stamp.dims, np.asarray(stamp.values), dict(stamp.attrs))


@contextlib.contextmanager
def open_fields(path: Path | str, atmos_path: Path | str | None = None, *, inputs=DEFAULT_INPUTS,
                outputs=DEFAULT_OUTPUTS, variables: dict[str, str] | None = None, mask_variable: str = AUTO,
                lat_variable: str = AUTO, need_lat: bool = True, need_ice: bool = False, domain: str = TOOLKIT,
                mask: str = "variable", zeroed=(), optional=(), coordinates: tuple | None = None):
    """The file (and the atmosphere file) open, every variable found (resolve_variables) and read as training reads
    it (field_view: surface levels, Gaussian axes broadcast, the pair matched by coordinate value), the `zeroed`
    inputs as fields of 0 (zero_fields), `optional` names where a file has them; with `coordinates` (latitude and
    longitude names, None for the file's own: find_coordinates) the cells' coordinates too: a Fields, for
    select_patterns and read_shard. Closed on exit."""
    path = Path(path).expanduser()
    with contextlib.ExitStack() as files:
        sources = [Source("--data", path, files.enter_context(open_dataset(path)))]
        if atmos_path is not None:
            atmos_path = Path(atmos_path).expanduser()
            sources.append(Source("--data-atmos", atmos_path,
                                  files.enter_context(open_dataset(atmos_path, "--data-atmos"))))
        found, mask_key, lat = resolve_variables(sources, list(inputs), list(outputs), variables=variables,
                                                 mask_variable=mask_variable, lat_variable=lat_variable,
                                                 need_lat=need_lat, need_ice=need_ice, domain=domain, mask=mask,
                                                 zeroed=zeroed, optional=optional)
        keys, axes_1d = ("", ""), False
        located = None if coordinates is None else find_coordinates(sources, *coordinates)
        if located is not None:
            keys = tuple(name for _, name in located)
            for key, hit in zip(keys, located, strict=True):
                found.setdefault(key, hit)
            axes_1d = all(found[key][0].ds[found[key][1]].ndim == 1 for key in keys)
        view, levels, reordered = field_view(sources, found, mask_key, lat, others=keys)
        label = f"{path} (with --data-atmos {atmos_path})" if atmos_path is not None else str(path)
        first = next((name for name in [*inputs, *outputs] if name in found), None)
        if zeroed:
            zero_fields(view, zeroed, first, label)
        time = leading_time(found, first) if first is not None else None
        yield Fields(view, found, mask_key, lat, levels, reordered, label, list(zeroed), keys, axes_1d, time)


def check_zeroed(domain: str, zeroed, outputs_not_read, variables: dict[str, str] | None) -> None:
    """One line, before any file is read, for a choice the domain's reader cannot honour: an output it does not read
    (its target would be 0 everywhere), a --variables name for an input it gives as 0."""
    if outputs_not_read:
        name = outputs_not_read[0]
        raise UsageError(f"--outputs {name}: --domain {domain}'s reader reads no {name} (its target would be 0 at "
                         "every pattern); give --domain toolkit to train on the file's")
    named = [name for name in zeroed if variables and name in variables]
    if named:
        raise UsageError(f"--variables {named[0]}={variables[named[0]]}: --domain {domain}'s reader reads no "
                         f"{named[0]} and trains on 0 for it; leave it out, or give --domain toolkit to read it")


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
    domain: str = TOOLKIT,
    mask: str = "variable",
) -> UfsPatterns:
    """Find the variables (explicit `variables` {our name: name in the file}, else ours, CICE's, CF's; in `path`
    and the optional atmosphere file `atmos_path`, which must be on the same grid; fields with a trailing level
    read at the surface, a Gaussian pair matched by coordinate value: field_view), select the patterns as `domain`
    does (ufs_domains; --domain toolkit: the mask "auto" tries tmask then umask, "" none, or `mask`
    "thickness-tair"; the latitudes: "auto" takes the mask's own, TLAT or ULAT, first; `hemisphere`; `open_water`
    False leaves aice <= 0 out; a cap of `max_patterns`, or of `max_patterns_per_rank` x the process count, the
    smaller), read this rank's strided share, refuse NaNs (counted over all ranks), merge the training statistics
    over the ranks (float64 count/mean/M2; a std below 1e-6 becomes 1), then assemble every shard in pattern order
    on every rank. The inputs that the domain's reader does not read are 0 in every pattern, as that reader gives
    them (aibalance-b1eccbc: sice, uocn, vocn, flwdn, fswdn; ufs_domains.zeroed_inputs), said in meta["zeroed"] and
    a line of describe_layout. A collective: every rank calls it."""
    from toolkit.run.distributed import merge_moments, std_from_moments

    check_domain(domain, mask=mask, mask_variable=mask_variable, lat_variable=lat_variable, min_abs_lat=min_abs_lat,
                 hemisphere=hemisphere, open_water=open_water, max_patterns=max_patterns,
                 max_patterns_per_rank=max_patterns_per_rank)
    inputs, outputs = list(inputs), list(outputs)
    zeroed = zeroed_inputs(domain, inputs)
    check_zeroed(domain, zeroed, zeroed_inputs(domain, outputs), variables)
    path = data_path = Path(path).expanduser()
    rank, world = accelerator.process_index, accelerator.num_processes
    cap = min((c for c in (max_patterns, max_patterns_per_rank * world) if c), default=0)
    toolkit_domain = domain == TOOLKIT
    with open_fields(path, atmos_path, inputs=inputs, outputs=outputs, variables=variables,
                     mask_variable=mask_variable, lat_variable=lat_variable,
                     need_lat=toolkit_domain and (min_abs_lat > 0 or hemisphere != "both"), need_ice=not open_water,
                     domain=domain, mask=mask, zeroed=zeroed) as fields:
        ds, found, mask_key, lat, path = fields.view, fields.found, fields.mask_key, fields.lat, fields.label
        atmos_path = None if atmos_path is None else Path(atmos_path).expanduser()
        names = inputs + outputs
        selection = select_patterns(
            ds,
            path,
            names=names,
            mask_variable=mask_key,
            lat_variable=lat,
            min_abs_lat=min_abs_lat,
            thin=thin,
            max_patterns=max_patterns,
            val_fraction=val_fraction,
            seed=seed,
            hemisphere=hemisphere,
            ice_variable="" if open_water else "aice",
            domain=domain,
            mask=mask,
            max_patterns_per_rank=max_patterns_per_rank,
            world=world,
        )
        shard = torch.from_numpy(read_shard(ds, path, names, selection.cells, rank, world))
        units = {name: str(ds[name].attrs.get("units", "")) for name in names}
        limits = {name: physical_range(name, units[name], range_factor) for name in names}
        attributes = {key: (value.item() if hasattr(value, "item") else value) for key, value in ds.attrs.items()}

    bad = counted_over_ranks(accelerator, (~torch.isfinite(shard)).sum(dim=0))
    for name, count in zip(names, bad, strict=True):
        if count:
            kind = "input" if name in inputs else "output"
            unmasked = (f"; --domain {domain} keeps every cell of its latitudes, land too "
                        f"({domain_rule(domain).summary})" if mask_kind(domain, mask) == "none" else "")
            raise UsageError(
                f"--data {path}: {kind} field {name!r} has {count} NaN/inf values inside the "
                f"sea-ice domain ({len(selection.cells)} patterns); fill them or mask those cells "
                f"(--mask-variable) before training{unmasked}"
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
        "variables": {name: found[name][1] for name in names if name not in zeroed},
        "zeroed": zeroed,  # inputs given as 0 in every pattern, as the domain's reader gives them
        # what only the selection reads (thick for --mask thickness-tair; aice for a team's domain when not an output)
        "selection_variables": {key: var for key, (_, var) in found.items()
                                if key not in (*names, mask_key, lat) or key in zeroed},
        "from_atmosphere": [name for name in names if name in found and name not in zeroed
                            and found[name][0].flag == "--data-atmos"],
        "mask_variable": mask_key,
        "lat_variable": lat,
        "hemisphere": hemisphere,
        "open_water": open_water,
        "max_patterns": cap if toolkit_domain else max_patterns or max_patterns_per_rank * world,
        "domain": domain,
        "mask": mask_kind(domain, mask),
        "where": selection.where,  # the domain's cells in words
        "levels": describe_levels(fields.levels),  # "" when no field had a level dimension
        "reordered": fields.reordered,  # "" unless the atmosphere's cells were matched to the ocean's by value
    }
    meta["fingerprint"] = patterns_fingerprint(data_path, atmos_path, meta, thin, max_patterns_per_rank,
                                               selection.depends_on_world)
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
# The CICE history fields that aibalance c710abb's reader reads besides the 14 (ufsemulator/data.py var_names:
# frzmlt_h, strocnx_h, strocny_h, strairx_h, strairy_h), written by the generator with --naming cice; derived from
# the fields above (no random draw: every other field keeps its values), outside the aice formula.
# name: (units, long name)
CICE_EXTRA_FIELDS = {
    "frzmlt": ("W/m^2", "freeze/melt potential"),
    "strocnx": ("N/m^2", "ocean/ice stress (x)"),
    "strocny": ("N/m^2", "ocean/ice stress (y)"),
    "strairx": ("N/m^2", "atm/ice stress (x)"),
    "strairy": ("N/m^2", "atm/ice stress (y)"),
}


def cice_extra_fields(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CICE_EXTRA_FIELDS from the generated fields: the freeze/melt potential from the sea surface's distance to
    freezing (capped at +-1000 W/m^2 as CICE caps it), the stresses as quadratic drag of the ocean current (water
    density 1026 kg/m^3, drag 5.5e-3) and of the wind (air 1.3 kg/m^3, drag 1.3e-3)."""
    water, air = 1026.0 * 5.5e-3, 1.3 * 1.3e-3
    current, wind = np.hypot(f["uocn"], f["vocn"]), np.hypot(f["uatm"], f["vatm"])
    return {
        "frzmlt": np.clip(-400.0 * (f["sst"] - 271.35), -1000.0, 1000.0),
        "strocnx": water * current * f["uocn"],
        "strocny": water * current * f["vocn"],
        "strairx": air * wind * f["uatm"],
        "strairy": air * wind * f["vatm"],
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
    layout: str = "cice",
) -> Path:
    """Write a CICE-like netCDF file (dims time=1, nj, ni; TLAT/TLON/tmask) with the 14 input fields and aice.

    naming="cice": the fields carry the CICE history names (sst_h, Tair_h, Qref_h, aice_h, ...; the same values
    and units) and the file also holds the U-cell mask and coordinates (umask: a T cell whose east, north and
    north-east neighbours are ocean too; ULAT/ULON half a cell to the north-east) and every other variable
    aibalance c710abb's reader reads (frzmlt_h, strocnx_h, strocny_h, strairx_h, strairy_h: cice_extra_fields).
    atmos_out: the atmospheric fields (ATMOSPHERE_FIELDS) go to that second file, on the same grid, with TLAT/TLON;
    the rest stay in `out`.

    layout="gaussian-cf" (atmos_out required): the pair aibalance reads today (ufs_cf.write_gaussian_cf): a Gaussian
    grid (latitudes north to south, longitudes 0 .. 360), 1-D latitude/longitude, CF names, the ocean/ice fields
    and sea_water_cell_thickness (lat, lon, lev) with the surface at lev 0, the atmosphere's (lat, lon)."""
    if naming not in ("ours", "cice"):
        raise UsageError(f"--naming {naming} is invalid; give ours or cice")
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout} is invalid; give one of {', '.join(LAYOUTS)}")
    if layout == "gaussian-cf" and atmos_out is None:
        raise UsageError("--layout gaussian-cf writes a pair of files: give --atmos-out for the atmosphere's")
    xr = extras.xarray()
    from tqdm.auto import tqdm

    out = Path(out).expanduser()
    rng = np.random.default_rng(seed)
    if layout == "gaussian-cf":
        lat1, lon1 = gaussian_latitudes(nlat), np.arange(nlon) * 360.0 / nlon
    else:
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
    attributes = {
        "title": "synthetic GDAS-like CICE/MOM6 fields for the UFS sea-ice emulator",
        "noise_sigma": float(sigma),
        "aice_formula": AICE_FORMULA,
        "seed": int(seed),
        "generator": "python -m toolkit.data.ufs synth",
    }
    if layout == "gaussian-cf":
        units = {name: FIELDS[name][0] for name in FIELDS} | {"aice": "1"}
        write_gaussian_cf(out, Path(atmos_out).expanduser(), lat1, lon1, {**f, "aice": aice}, units, ocean,
                          attributes | {"layout": "gaussian-cf"})
        return out
    rename = (lambda name: CICE_NAMES.get(name, name)) if naming == "cice" else (lambda name: name)
    dims = ("time", "nj", "ni")
    ocean_vars, atmos_vars = {}, {}
    extra = cice_extra_fields(f) if naming == "cice" else {}
    for name in tqdm([*FIELDS, "aice", *extra], desc="fields", unit="field", leave=False):
        values = aice if name == "aice" else extra[name] if name in extra else f[name]
        values = np.where(ocean, values, np.nan).astype(np.float32)[None]
        units, long_name = {**FIELDS, **CICE_EXTRA_FIELDS}.get(name, ("1", "ice area (aggregate)"))
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
    synth.add_argument("--naming", help="variable names with --layout cice: ours (sst, aice, ...; the default) or "
                       "cice (sst_h, ...)")
    synth.add_argument("--atmos-out", type=Path, help="write the atmospheric fields to this second file")
    synth.add_argument("--layout", default="cice", help="cice (the default: CICE history layout, (time, nj, ni) "
                       "fields, 2-D TLAT/TLON, tmask) or gaussian-cf (aibalance's pair, --atmos-out required: a "
                       "Gaussian grid, 1-D latitude/longitude, CF names, ocean fields (lat, lon, lev), surface at "
                       "lev 0, and sea_water_cell_thickness)")
    args = parser.parse_args(argv)
    if args.layout not in LAYOUTS:
        raise UsageError(f"--layout {args.layout} is invalid; give cice (CICE history files) or gaussian-cf "
                         "(aibalance's CF pair on a Gaussian grid)")
    if args.layout == "gaussian-cf" and args.naming is not None:
        raise UsageError(f"--naming {args.naming}: --layout gaussian-cf writes CF names; --naming is for --layout "
                         "cice")
    if args.layout == "gaussian-cf" and args.atmos_out is None:
        raise UsageError("--layout gaussian-cf writes a pair of files: give --atmos-out FILE for the atmosphere's "
                         "(--out is the ocean/ice file)")
    args.naming = args.naming or "ours"
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
                      atmos_out=args.atmos_out, layout=args.layout)
    if args.layout == "gaussian-cf":
        print(f"wrote {path} (ocean/ice, (lat, lon, lev) fields, surface at lev 0) and {args.atmos_out} "
              f"(atmosphere: {', '.join(CF_ATMOSPHERE)}): {args.nlat} x {args.nlon} Gaussian grid, CF names "
              f"(noise sigma {args.sigma})")
        return
    where = f" ({', '.join(ATMOSPHERE_FIELDS)} in {args.atmos_out})" if args.atmos_out else ""
    print(f"wrote {path}: {args.nlat} x {args.nlon} grid, 14 inputs and aice{where} (noise sigma {args.sigma}, "
          f"{args.naming} names)")


if __name__ == "__main__":
    main()
