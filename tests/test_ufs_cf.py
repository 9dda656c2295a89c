"""aibalance's current files (b1eccbc): CF names in a pair on a Gaussian grid, 1-D latitude/longitude, ocean fields
(lat, lon, lev) read at the surface level with one line saying so, the teams' thickness/tair mask (--mask
thickness-tair); the generator's --layout gaussian-cf writes such a pair and the recipe trains from it; hostile
variants are read right (latitudes in the other order, longitudes -180 .. 180 against 0 .. 360, other dimension
names, the atmosphere's level at its last index) or refused in one line naming the file and the variable (a level
dimension of length 0, a 2-D latitude beside a 1-D longitude, longitudes that are not the other file's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from accelerate import Accelerator
from conftest import read_json, run_recipe

from toolkit.data.ufs import DEFAULT_INPUTS, clean_aice, describe_layout, load_patterns, main, synthesize
from toolkit.data.ufs_cf import AIBALANCE_CF, CF_ATMOSPHERE, gaussian_latitudes
from toolkit.errors import UsageError

SEVEN = {"sst": "sea_water_potential_temperature", "sss": "sea_water_salinity", "tsfc": "skin_temperature_at_surface",
         "hs": "sea_ice_snow_thickness", "uocn": "eastward_sea_water_velocity",
         "vocn": "northward_sea_water_velocity", "qref": "water_vapor_mixing_ratio_wrt_moist_air"}
LEVELS_LINE = ("levels: sst, sss, hi, hs, sice, uocn, vocn, aice, thick from --data at index 0 of 'lev' (2 levels; the "
               "ocean surface, as aibalance reads it)")


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    where = tmp_path_factory.mktemp("gaussian-cf")
    synthesize(where / "ocean.nc", seed=5, nlat=16, nlon=32, layout="gaussian-cf", atmos_out=where / "atmos.nc")
    return where / "ocean.nc", where / "atmos.nc"


def surface(ocean, atmos, name):
    """Our field as aibalance reads it: the ocean's at lev 0, the atmosphere's 2-D field."""
    cf = AIBALANCE_CF[name]
    return np.asarray(atmos[cf].values if name in CF_ATMOSPHERE else ocean[cf].values[:, :, 0], dtype=np.float64)


def rows(*tensors):
    """The patterns as a set: rows sorted, so that the split into training and validation does not matter."""
    x = torch.cat(tensors).numpy()
    return x[np.lexsort(x.T[::-1])]


def test_the_generated_pair_is_aibalances_layout(pair):
    ocean, atmos = pair
    with xr.open_dataset(ocean) as o, xr.open_dataset(atmos) as a:
        for ds in (o, a):
            assert ds["latitude"].dims == ("lat",) and ds["longitude"].dims == ("lon",)
            assert np.allclose(ds["latitude"].values, gaussian_latitudes(16), atol=1e-5)  # north to south
            assert ds["longitude"].values[0] == 0 and ds["longitude"].values[-1] < 360
        assert o["sea_water_potential_temperature"].dims == ("lat", "lon", "lev")
        assert o["sea_water_cell_thickness"].dims == ("lat", "lon", "lev")
        assert a["air_temperature"].dims == ("lat", "lon") and set(SEVEN.values()) <= set(o.variables) | set(
            a.variables)
        ocean_cells = o["sea_water_cell_thickness"].values[:, :, 0] > 0
        fields = {name: surface(o, a, name)[ocean_cells] for name in DEFAULT_INPUTS}
        residual = surface(o, a, "aice")[ocean_cells] - clean_aice(fields)
        assert abs(residual.std() / float(o.attrs["noise_sigma"]) - 1) < 0.25  # the noise at the surface level
        assert np.all(o["sea_water_potential_temperature"].values[:, :, 1][ocean_cells]
                      != o["sea_water_potential_temperature"].values[:, :, 0][ocean_cells])  # below differs


def test_the_pair_is_read_at_the_surface_under_cf_names_with_the_thickness_tair_mask(pair, accelerator):
    ocean, atmos = pair
    patterns = load_patterns(accelerator, ocean, atmos_path=atmos, mask="thickness-tair", seed=1)
    meta = patterns.meta
    assert meta["variables"] == {name: AIBALANCE_CF[name] for name in [*DEFAULT_INPUTS, "aice"]}
    assert all(meta["variables"][name] == cf for name, cf in SEVEN.items())
    assert meta["selection_variables"] == {"thick": "sea_water_cell_thickness"} and meta["lat_variable"] == "latitude"
    assert describe_layout(meta) == [LEVELS_LINE, "domain (toolkit): 0 < thick <= 500 and 183.15 <= tair <= 333.15 "
                                                  "and |latitude| >= 40.0"]
    with xr.open_dataset(ocean) as o, xr.open_dataset(atmos) as a:
        thick, tair = o["sea_water_cell_thickness"].values[:, :, 0], a["air_temperature"].values
        lat = np.repeat(a["latitude"].values[:, None], a.sizes["lon"], axis=1)  # aibalance's broadcast
        domain = (thick > 0) & (thick <= 500) & (tair >= 183.15) & (tair <= 333.15) & (np.abs(lat) >= 40)
        expected = np.stack([surface(o, a, name)[domain] for name in [*DEFAULT_INPUTS, "aice"]], axis=1)
    assert meta["domain_cells"] == meta["patterns"] == int(domain.sum()) > 100
    got = rows(torch.cat([patterns.train_inputs, patterns.train_targets], 1),
               torch.cat([patterns.valid_inputs, patterns.valid_targets], 1))
    assert np.array_equal(got, expected[np.lexsort(expected.T[::-1])])


# ---- hostile variants: handled (the same patterns) or one line ---------------------------------------------------


def _flip_latitudes(ds):
    return ds.isel(lat=slice(None, None, -1))


def _longitudes_from_minus_180(ds):
    ds = ds.roll(lon=ds.sizes["lon"] // 2)
    values = (ds["longitude"].values + 180.0) % 360.0 - 180.0
    ds["longitude"] = ("lon", values.astype(np.float32), ds["longitude"].attrs)
    return ds


def _other_dimension_names(ds):
    return _longitudes_from_minus_180(_flip_latitudes(ds)).rename_dims(lat="y", lon="x")


def _atmosphere_levels(ds):
    """tair with 3 levels, the right one last (aibalance's nlevs - 1); the others far off."""
    tair = ds["air_temperature"]
    ds["air_temperature"] = (("lat", "lon", "pfull"), np.stack([tair.values + 60, tair.values + 30, tair.values], -1),
                             tair.attrs)
    return ds


HANDLED = {
    "atmosphere latitudes south to north": (_flip_latitudes, "latitudes 'latitude' in reverse order"),
    "atmosphere longitudes -180 .. 180": (_longitudes_from_minus_180, "longitudes 'longitude' shifted by 16 of 32 "
                                          "(-180 .. 168.75 against 0 .. 348.75)"),
    "both, under other dimension names": (_other_dimension_names, "latitudes 'latitude' in reverse order"),
    "atmosphere fields with levels": (_atmosphere_levels, "tair from --data-atmos at index 2 of 'pfull' (3 levels; "
                                      "the lowest atmosphere level"),
}


@pytest.mark.parametrize("case", list(HANDLED))
def test_a_pair_stored_otherwise_gives_the_same_patterns(case, pair, accelerator, tmp_path):
    ocean, atmos = pair
    edit, said = HANDLED[case]
    with xr.open_dataset(atmos) as ds:
        edit(ds.load()).to_netcdf(tmp_path / "atmos.nc", engine="netcdf4")
    plain = load_patterns(accelerator, ocean, atmos_path=atmos, domain="aibalance-b1eccbc", seed=1)
    other = load_patterns(accelerator, ocean, atmos_path=tmp_path / "atmos.nc", domain="aibalance-b1eccbc", seed=1)
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets"):
        assert torch.equal(getattr(other, name), getattr(plain, name)), name
    assert any(said in line for line in describe_layout(other.meta)), describe_layout(other.meta)


@pytest.mark.parametrize("names", [{}, {"lat": "b", "lon": "a"}], ids=["lat-lon", "names-that-say-nothing"])
def test_a_pair_stored_lon_lat_gives_the_patterns_in_the_order_of_lat_lon(names, pair, accelerator, tmp_path):
    """Both files' fields stored (lon, lat[, lev]): the cells are numbered by latitude row, then longitude, as when
    stored (lat, lon), so the patterns and their order are the same; under dimension names that say neither, the 1-D
    latitude and longitude tell the rows from the columns."""
    ocean, atmos = pair
    turned = {}
    for which, path in (("ocean", ocean), ("atmos", atmos)):
        with xr.open_dataset(path) as ds:
            ds.load().transpose("lon", "lat", ...).rename_dims(names).to_netcdf(tmp_path / f"{which}.nc")
        turned[which] = tmp_path / f"{which}.nc"
    with xr.open_dataset(turned["ocean"]) as ds:
        assert ds["sea_water_potential_temperature"].dims == (names.get("lon", "lon"), names.get("lat", "lat"), "lev")
    plain = load_patterns(accelerator, ocean, atmos_path=atmos, domain="aibalance-b1eccbc", seed=1)
    other = load_patterns(accelerator, turned["ocean"], atmos_path=turned["atmos"], domain="aibalance-b1eccbc", seed=1)
    assert other.meta["grid"] == plain.meta["grid"] == [16, 32]
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets"):
        assert torch.equal(getattr(other, name), getattr(plain, name)), name


def _empty_level(ds):
    ds["sea_water_salinity"] = (("lat", "lon", "nlev"), np.zeros((ds.sizes["lat"], ds.sizes["lon"], 0), np.float32))
    return ds


def _latitude_2d(ds):
    ds["latitude"] = (("lat", "lon"), np.repeat(ds["latitude"].values[:, None], ds.sizes["lon"], axis=1))
    return ds


def _longitudes_off_grid(ds):
    ds["longitude"] = ds["longitude"] + 0.5
    return ds


def _a_longitude_nan(ds):
    values = ds["longitude"].values.copy()
    values[5] = np.nan
    ds["longitude"] = ("lon", values, ds["longitude"].attrs)
    return ds


REFUSED = {
    "a level dimension of length 0": ("ocean", _empty_level, "variable 'sea_water_salinity' has a level dimension "
                                      "'nlev' of length 0"),
    "a 2-D latitude, a 1-D longitude": ("ocean", _latitude_2d, "latitude 'latitude' has dimensions (lat, lon) but "
                                        "longitude 'longitude' has (lon): give both 1-D (a Gaussian grid's axes) or "
                                        "both 2-D"),
    "longitudes half a cell off": ("atmos", _longitudes_off_grid, "its longitudes 'longitude' (32 values, 0.5 .. "
                                   "349.25) are not those of --data"),
    "a NaN longitude in the ocean file": ("ocean", _a_longitude_nan, "--data {ocean}: longitude 'longitude' is NaN/inf "
                                          "at 1 of its 32 values (e.g. index 5); a Gaussian grid's longitudes must "
                                          "all be finite (degrees east): fill them"),
    "a NaN longitude in the atmosphere file": ("atmos", _a_longitude_nan, "--data-atmos {atmos}: longitude "
                                               "'longitude' is NaN/inf at 1 of its 32 values (e.g. index 5)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_hostile_pair_is_one_line_naming_file_and_variable(case, pair, accelerator, tmp_path):
    ocean, atmos = pair
    which, edit, fragment = REFUSED[case]
    files = {"ocean": ocean, "atmos": atmos}
    with xr.open_dataset(files[which]) as ds:
        edit(ds.load()).to_netcdf(tmp_path / f"{which}.nc", engine="netcdf4")
    files[which] = tmp_path / f"{which}.nc"
    with pytest.raises(UsageError) as error:
        load_patterns(accelerator, files["ocean"], atmos_path=files["atmos"], domain="aibalance-b1eccbc")
    message, fragment = str(error.value), fragment.format(**files)
    assert "\n" not in message and fragment in message and str(files[which]) in message, message


def test_a_cf_pair_without_a_mask_variable_points_at_the_thickness_tair_mask(pair, accelerator):
    ocean, atmos = pair
    with pytest.raises(UsageError, match=r"no mask variable 'tmask' \(nor 'umask'\) \(a CF file: --mask "
                                         "thickness-tair draws aibalance's ocean"):
        load_patterns(accelerator, ocean, atmos_path=atmos)


# ---- the generator's flags; a few training steps from the pair ---------------------------------------------------

GENERATOR_BAD_FLAGS = {
    "no atmosphere file": (["--layout", "gaussian-cf"], "--layout gaussian-cf writes a pair of files: give "
                           "--atmos-out FILE"),
    "CICE names": (["--layout", "gaussian-cf", "--naming", "cice", "--atmos-out", "{tmp}/a.nc"],
                   "--naming cice: --layout gaussian-cf writes CF names"),
    "an unknown layout": (["--layout", "cf"], "--layout cf is invalid; give cice (CICE history files) or gaussian-cf"),
}


@pytest.mark.parametrize("case", list(GENERATOR_BAD_FLAGS))
def test_generator_layout_flags_are_one_line_and_write_nothing(case, tmp_path, capsys):
    flags, fragment = GENERATOR_BAD_FLAGS[case]
    with pytest.raises(SystemExit) as done:
        main(["synth", "--out", str(tmp_path / "x.nc"), "--nlat", "4", "--nlon", "8",
              *[f.format(tmp=tmp_path) for f in flags]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and fragment.format(tmp=tmp_path) in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_the_recipe_trains_from_a_generated_pair(tmp_path):
    main(["synth", "--out", str(tmp_path / "ocean.nc"), "--atmos-out", str(tmp_path / "atmos.nc"), "--layout",
          "gaussian-cf", "--nlat", "16", "--nlon", "32", "--seed", "2"])
    out = tmp_path / "run"
    result = run_recipe(["--data", str(tmp_path / "ocean.nc"), "--data-atmos", str(tmp_path / "atmos.nc"),
                         "--domain", "aibalance-b1eccbc", "--epochs", "1", "--batch-size", "100", "--log-with", "csv",
                         "--output-dir", str(out)], recipe="ufs_emulator")
    lines = result.stdout.splitlines()
    zeroed = lines.index(
        "zeroed: sice, uocn, vocn, flwdn, fswdn are 0 in every pattern, as --domain aibalance-b1eccbc's reader gives "
        "them (aibalance b1eccbc read_netcdf_data_pair reads none of them and filter_data fills them with zeros), "
        "whatever the files hold; --domain toolkit (--mask thickness-tair) reads them")
    assert lines[zeroed - 1].startswith("variables: sst<-sea_water_potential_temperature") and "sice<-0" in lines[
        zeroed - 1]  # said at the start, before the data's size and the model
    assert lines[zeroed + 1] == ("levels: sst, sss, hi, hs, aice, thick from --data at index 0 of 'lev' (2 levels; the "
                                 "ocean surface, as aibalance reads it)")
    assert "domain (aibalance-b1eccbc): 0 < thick <= 500 and 183.15 <= tair <= 333.15 and aice > 0" in result.stdout
    recorded = read_json(out / "config.json")
    assert recorded["config"]["domain"] == "aibalance-b1eccbc" and recorded["data"]["where"].endswith("aice > 0")
    summary = read_json(out / "summary.json")
    assert summary["global_step"] == 2 and np.isfinite(summary["final_metrics"]["val_rmse_aice"])
