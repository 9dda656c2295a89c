"""CF-named files on a Gaussian grid, as aibalance reads them today (b1eccbc ufsemulator/data.py, cf_mappings.py):
an ocean/ice file and an atmosphere file, 1-D latitude and longitude, ocean fields stored (lat, lon, lev).

What the reader does with them (toolkit.data.ufs builds its view of the fields here):

- the grid of a file is its latitude/longitude variables' (TLAT, ULAT, lat, latitude or standard_name latitude, and
  the matching longitude): both 2-D (a CICE grid: each cell's coordinates) or both 1-D (a Gaussian grid's axes,
  broadcast to every cell when the latitude is read); one 1-D and one 2-D is refused in one line;
- a field with a trailing dimension that is not one of the grid's is read at one level of it: index 0 in --data
  (the ocean's surface layer, aibalance's `[:, :, 0]`), the last index in --data-atmos (the lowest model level,
  aibalance's `nlevs - 1`); one line says which (`describe_levels`); a level dimension of length 0 is refused;
- with two Gaussian files, the atmosphere's fields are matched to the ocean's cells by latitude and longitude VALUE,
  not position: latitudes in the other order, longitudes -180 .. 180 against 0 .. 360 are read right (and said
  in one line); coordinates that are not the same set (to 1e-3 degrees, longitudes modulo 360) are refused;
- which inputs are read is the domain's: aibalance's reader takes sst, sss, hi, hs, aice and the thickness from the
  ocean file and tair, uatm, vatm, tsfc, qref from the atmosphere's, and gives sice, uocn, vocn, flwdn and fswdn as
  0 at every pattern (--domain aibalance-b1eccbc does too: ufs_domains.zeroed_inputs); our other domains read every
  input the files hold under the names below.

The generator's `--layout gaussian-cf` writes such a pair (`write_gaussian_cf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.errors import UsageError
from toolkit.process import extras

# aibalance b1eccbc cf_mappings.py (CF_OCN, CF_ATM), our name -> the CF name its files use; flwdn and fswdn are not
# there, and the generator writes them under their CF standard names. What aibalance's reader (read_netcdf_data_pair)
# reads is less than this map: sst, sss, aice, hi, hs, thick from the ocean file and tair, uatm, vatm, tsfc, qref from
# the atmosphere's; it reads no sice, uocn, vocn, flwdn or fswdn, and its filter_data gives each of them 0 at every
# pattern. --domain aibalance-b1eccbc does the same (ufs_domains.zeroed_inputs); the other domains read them here.
AIBALANCE_CF = {
    "sst": "sea_water_potential_temperature",
    "sss": "sea_water_salinity",
    "aice": "sea_ice_area_fraction",
    "hi": "sea_ice_thickness",
    "hs": "sea_ice_snow_thickness",
    "thick": "sea_water_cell_thickness",
    "sice": "sea_ice_salinity",
    "uocn": "eastward_sea_water_velocity",
    "vocn": "northward_sea_water_velocity",
    "tair": "air_temperature",
    "uatm": "eastward_wind",
    "vatm": "northward_wind",
    "tsfc": "skin_temperature_at_surface",
    "qref": "water_vapor_mixing_ratio_wrt_moist_air",
    "flwdn": "surface_downwelling_longwave_flux_in_air",
    "fswdn": "surface_downwelling_shortwave_flux_in_air",
}
CF_ATMOSPHERE = ("tair", "uatm", "vatm", "tsfc", "qref", "flwdn", "fswdn")  # aibalance's CF_ATM, with the fluxes
LAT_CANDIDATES = ("TLAT", "ULAT", "lat", "latitude")
LON_CANDIDATES = ("TLON", "ULON", "lon", "longitude")
LON_FOR_LAT = dict(zip(LAT_CANDIDATES, LON_CANDIDATES, strict=True))
SURFACE_INDEX = {"--data": 0, "--data-atmos": -1}  # the ocean's top layer; the atmosphere's lowest level
SURFACE_WORDS = {"--data": "the ocean surface, as aibalance reads it", "--data-atmos": "the lowest atmosphere level, "
                 "as aibalance reads it"}
COORDINATE_TOLERANCE = 1e-3  # degrees: two files' latitudes/longitudes are one grid's within this


@dataclass(frozen=True)
class Axes:
    """A file's horizontal grid: its latitude and longitude variables and the grid's dimension names (y, x)."""

    lat: str
    lon: str | None
    dims: tuple[str, str]
    gaussian: bool  # 1-D latitude and longitude: a Gaussian (or any regular lat/lon) grid's axes


def _squeezed_dims(array) -> tuple[str, ...]:
    dims = tuple(str(d) for d in array.dims)
    while len(dims) > 2 and array.sizes[dims[0]] == 1:
        dims = dims[1:]
    return dims


def _standard(ds, standard: str) -> str | None:
    return next((str(n) for n, v in ds.variables.items() if v.attrs.get("standard_name") == standard), None)


def file_axes(source) -> Axes | None:
    """The grid of `source` (flag, path, ds) from its latitude/longitude variables: both 2-D, or both 1-D (a Gaussian
    grid's axes); None without a latitude, or with a 1-D one and no longitude. One 1-D and one 2-D is refused."""
    ds = source.ds
    lat = next((n for n in LAT_CANDIDATES if n in ds.variables), None) or _standard(ds, "latitude")
    if lat is None:
        return None
    lon = LON_FOR_LAT.get(lat)
    if lon not in ds.variables:
        lon = next((n for n in LON_CANDIDATES if n in ds.variables), None) or _standard(ds, "longitude")
    lat_dims = _squeezed_dims(ds[lat])
    lon_dims = _squeezed_dims(ds[lon]) if lon is not None else None
    where = f"{source.flag} {source.path}"
    valid = "give both 1-D (a Gaussian grid's axes) or both 2-D (each cell's coordinates)"
    if lon_dims is not None and len(lon_dims) != len(lat_dims):
        raise UsageError(
            f"{where}: latitude {lat!r} has dimensions ({', '.join(lat_dims)}) but longitude {lon!r} has "
            f"({', '.join(lon_dims)}): {valid}"
        )
    if len(lat_dims) == 2:
        return Axes(lat, lon, lat_dims, False)
    if len(lat_dims) != 1 or lon is None:  # no grid this reader knows: the grid checks name the field if it is used
        return None
    if lon_dims == lat_dims:
        raise UsageError(
            f"{where}: latitude {lat!r} and longitude {lon!r} share their one dimension {lat_dims[0]!r}: that is a "
            f"list of points, not a grid; {valid}"
        )
    return Axes(lat, lon, (lat_dims[0], lon_dims[0]), True)


@dataclass(frozen=True)
class Level:
    """Where a field was read on its trailing level dimension."""

    flag: str
    variable: str
    dim: str
    index: int
    size: int


def at_surface(array, name: str, source, grids: list[tuple[str, str]]):
    """`array` with leading length-1 dimensions dropped and, when it has one more dimension after a known grid's two
    (a trailing level), read at the file's surface level: (the array, a Level or None). An array of another shape
    is returned as it is (the grid checks name it)."""
    while array.ndim > 2 and array.shape[0] == 1:
        array = array.isel({array.dims[0]: 0})
    dims = tuple(str(d) for d in array.dims)
    if array.ndim != 3 or not any(set(dims[:2]) == set(grid) and dims[2] not in grid for grid in grids):
        return array, None
    level, size = dims[2], array.shape[2]
    if size == 0:
        raise UsageError(
            f"{source.flag} {source.path}: variable {name!r} has a level dimension {level!r} of length 0 "
            f"(dimensions {dict(array.sizes)}): there is no level to read; give it at least one level, or store "
            "the surface field 2-D (lat, lon)"
        )
    index = SURFACE_INDEX.get(source.flag, 0) % size
    return array.isel({level: index}), Level(source.flag, name, level, index, size)


def broadcast_axis(source, axes: Axes, name: str):
    """A 1-D latitude or longitude of a Gaussian file as a 2-D field on its grid (dims axes.dims)."""
    xr = extras.xarray()
    ds = source.ds
    values = np.asarray(ds[name].values).reshape(-1)
    shape = (ds.sizes[axes.dims[0]], ds.sizes[axes.dims[1]])
    grid = np.broadcast_to(values[:, None] if name == axes.lat else values[None, :], shape)
    return xr.DataArray(np.array(grid), dims=axes.dims, attrs=dict(ds[name].attrs), name=name)


def _normalised(values: np.ndarray, period: float | None) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if period is None:
        return values
    values = np.mod(values, period)
    values[values > period - COORDINATE_TOLERANCE] -= period  # 359.9999 and -0.0001 are 0
    return values


def matching(reference: np.ndarray, other: np.ndarray, period: float | None = None) -> np.ndarray | None:
    """Indices i such that other[i] is reference's value at each position (within COORDINATE_TOLERANCE; longitudes
    modulo `period`), or None when the two are not the same set of coordinates."""
    a, b = _normalised(reference, period), _normalised(other, period)
    if len(a) != len(b) or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    index = np.empty(len(a), dtype=np.int64)
    index[np.argsort(a, kind="stable")] = np.argsort(b, kind="stable")
    return index if np.max(np.abs(b[index] - a), initial=0.0) <= COORDINATE_TOLERANCE else None


def _span(values: np.ndarray) -> str:
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    return f"{values[0]:g} .. {values[-1]:g}"


def _order(index: np.ndarray) -> str:
    n = len(index)
    if np.array_equal(index, np.arange(n)[::-1]):
        return "in reverse order"
    shift = int(index[0])
    if np.array_equal(index, (np.arange(n) + shift) % n):
        return f"shifted by {shift} of {n}"
    return "reordered"


def alignment(reference, reference_axes: Axes, other, other_axes: Axes) -> tuple[dict, str]:
    """How to read `other`'s fields on `reference`'s cells (both Gaussian): ({reference's dim name: the indices of
    other's values to take}, a line saying what was reordered, "" when nothing was). Refused in one line when the
    coordinates differ."""
    take, words = {}, []
    for which, period, position in (("latitude", None, 0), ("longitude", 360.0, 1)):
        ref_name = (reference_axes.lat, reference_axes.lon)[position]
        own_name = (other_axes.lat, other_axes.lon)[position]
        ref_values = np.asarray(reference.ds[ref_name].values)
        own_values = np.asarray(other.ds[own_name].values)
        for source, name, values in ((reference, ref_name, ref_values), (other, own_name, own_values)):
            unknown = ~np.isfinite(np.asarray(values, dtype=np.float64).reshape(-1))
            if unknown.any():  # every cell of its row (column) reads it: no cell can be matched without it
                valid = "-90 .. 90 degrees north" if period is None else "degrees east"
                raise UsageError(
                    f"{source.flag} {source.path}: {which} {name!r} is NaN/inf at {int(unknown.sum())} of its "
                    f"{unknown.size} values (e.g. index {int(np.flatnonzero(unknown)[0])}); a Gaussian grid's "
                    f"{which}s must all be finite ({valid}): fill them"
                )
        index = matching(ref_values, own_values, period)
        if index is None:
            raise UsageError(
                f"{other.flag} {other.path}: its {which}s {own_name!r} ({len(own_values.reshape(-1))} values, "
                f"{_span(own_values)}) are not those of {reference.flag} {reference.path} ({ref_name!r}: "
                f"{len(ref_values.reshape(-1))} values, {_span(ref_values)}), in any order: the two files must be on "
                f"one grid (every {which} of one in the other{', modulo 360' if period else ''}, to "
                f"{COORDINATE_TOLERANCE:g} degrees)"
            )
        if not np.array_equal(index, np.arange(len(index))):
            words.append(f"{which}s {own_name!r} {_order(index)} ({_span(own_values)} against {_span(ref_values)})")
            take[reference_axes.dims[position]] = index
    line = ""
    if words:
        line = (f"grid: {other.flag} {other.path} is read on {reference.flag} {reference.path}'s cells by "
                f"coordinate value: its {' and its '.join(words)}")
    return take, line


def describe_levels(levels: dict[str, Level]) -> str:
    """One line: which fields were read at which level of their trailing dimension, per file."""
    if not levels:
        return ""
    groups: dict[tuple, list[str]] = {}
    for name, level in levels.items():
        groups.setdefault((level.flag, level.dim, level.index, level.size), []).append(name)
    parts = []
    for (flag, dim, index, size), names in groups.items():
        parts.append(f"{', '.join(names)} from {flag} at index {index} of {dim!r} ({size} levels; "
                     f"{SURFACE_WORDS.get(flag, 'the first')})")
    return "levels: " + "; ".join(parts)


# ---- the generator's --layout gaussian-cf ----------------------------------------------------------------------


def gaussian_latitudes(nlat: int) -> np.ndarray:
    """The Gaussian grid's latitudes (degrees), north to south as NCEP's grids store them."""
    nodes, _ = np.polynomial.legendre.leggauss(nlat)
    return np.degrees(np.arcsin(nodes))[::-1].copy()


def write_gaussian_cf(ocean_out: Path, atmos_out: Path, lat1: np.ndarray, lon1: np.ndarray, fields: dict,
                      units: dict, ocean: np.ndarray, attributes: dict, levels: int = 2) -> None:
    """The pair aibalance reads: ocean/ice fields (lat, lon, lev) under CF names with a `levels`-deep level
    dimension (the surface values at lev 0; below, values no emulator should see), land as fill, and
    sea_water_cell_thickness (0 on land: aibalance's mask); atmosphere fields (lat, lon) everywhere (the air is
    over land too). Both files carry 1-D latitude(lat) / longitude(lon). Written whole or not at all."""
    xr = extras.xarray()
    axes = {
        "latitude": xr.Variable(("lat",), lat1.astype(np.float32), {"units": "degrees_north",
                                                                    "standard_name": "latitude"}),
        "longitude": xr.Variable(("lon",), lon1.astype(np.float32), {"units": "degrees_east",
                                                                     "standard_name": "longitude"}),
    }
    depth = np.arange(levels, dtype=np.float64)[None, None, :]
    ocean_vars, atmos_vars = dict(axes), dict(axes)
    for name, values in fields.items():
        cf = AIBALANCE_CF[name]
        attrs = {"units": units[name], "standard_name": cf}
        if name in CF_ATMOSPHERE:
            atmos_vars[cf] = xr.Variable(("lat", "lon"), values.astype(np.float32), attrs)
            continue
        # below the surface: the surface value shifted by a field-sized step (a reader taking the wrong level is off)
        step = 0.5 * (np.nanstd(values) + 1e-3)
        column = values[:, :, None] + step * depth
        column = np.where(ocean[:, :, None], column, np.nan).astype(np.float32)
        ocean_vars[cf] = xr.Variable(("lat", "lon", "lev"), column, attrs)
    thickness = np.where(ocean[:, :, None], 10.0 * 2.0 ** depth, 0.0).astype(np.float32)
    ocean_vars[AIBALANCE_CF["thick"]] = xr.Variable(("lat", "lon", "lev"), thickness, {
        "units": "m", "standard_name": AIBALANCE_CF["thick"]})
    for path, variables in ((ocean_out, ocean_vars), (atmos_out, atmos_vars)):
        ds = xr.Dataset(variables)
        ds.attrs.update(attributes)
        encoding = {name: {"_FillValue": np.float32(1e30)} for name in variables if name not in axes}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        ds.to_netcdf(partial, engine="netcdf4", encoding=encoding)
        partial.replace(path)
