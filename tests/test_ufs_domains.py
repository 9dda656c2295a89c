"""The teams' sea-ice domains (--domain), each checked cell for cell against a transcription of that team's code,
written here in plain Python/numpy from it, on generated files: JCSDA SOCA's IceEmul.h (selectData per pole with
clean data, on a file with open water (aice exactly 0) inside the mask, which its 0 < aice leaves out, and without
clean data (soca-unclean: beyond 60 degrees, no mask, no ice condition); prepData's first N per rank of the stride
cut to the smallest rank, on 1 and 3 ranks), aibalance c710abb's select_data (umask == 1, aice not < 0, the first N
in grid order) and its reader (read_netcdf_data, filter_data: the same patterns, value for value, from the generated
CICE file, which holds every variable it reads), and aibalance b1eccbc's read_netcdf_data_pair / filter_data on its
CF pair (the thickness/tair mask, aice > 0, the first N; sice, uocn, vocn, flwdn, fswdn zeros: the same patterns,
value for value); --domain toolkit stays ours. The gdas preset follows c710abb; the flags a team's domain fixes are
refused in one line before a file is opened."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from accelerate import Accelerator
from conftest import load_recipe

from toolkit.data.ufs import (
    CICE_NAMES,
    DEFAULT_INPUTS,
    describe_layout,
    describe_variables,
    load_patterns,
    open_fields,
    select_patterns,
    synthesize,
)
from toolkit.data.ufs_domains import DOMAINS
from toolkit.errors import UsageError
from toolkit.export.netcdf import selection_options

OPEN_WATER = (0.05, 0.25)  # aice in this band becomes open water, exactly 0 (the noise below 0 stays)


@pytest.fixture(scope="module")
def cice(tmp_path_factory):
    """A CICE history file (umask/ULAT beside tmask/TLAT; aice with noise below 0 and above 1) on 5-degree rows, so
    that a row of ULAT is exactly 40 (SOCA's > 40 leaves it out, >= would not), with every 7th ocean cell's masks
    at 0.7 (the teams' == 1 leaves them out, our > 0.5 keeps them), and open water inside the mask as a model
    writes it: aice exactly 0 where it was in OPEN_WATER (SOCA's 0 < aice leaves those out, 0 <= aice would not)."""
    where = tmp_path_factory.mktemp("domains")
    synthesize(where / "plain.nc", seed=3, nlat=36, nlon=72, naming="cice")
    with xr.open_dataset(where / "plain.nc") as plain:
        ds = plain.load()
    assert (ds["ULAT"].values == 40).any()
    for name in ("umask", "tmask"):
        values = ds[name].values.copy()
        values.reshape(-1)[np.flatnonzero(values.reshape(-1) == 1)[::7]] = 0.7
        ds[name] = (ds[name].dims, values, ds[name].attrs)
    aice = ds["aice_h"].values.copy()
    aice[(aice >= OPEN_WATER[0]) & (aice < OPEN_WATER[1])] = 0.0
    ds["aice_h"] = (ds["aice_h"].dims, aice, ds["aice_h"].attrs)
    ds.to_netcdf(where / "cice.nc", engine="netcdf4")
    return where / "cice.nc"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    where = tmp_path_factory.mktemp("domains-cf")
    synthesize(where / "ocean.nc", seed=3, nlat=48, nlon=96, layout="gaussian-cf", atmos_out=where / "atmos.nc")
    return where / "ocean.nc", where / "atmos.nc"


def flat(ds, name):
    """The variable as the teams read it: every value in file order (CICE: (time=1, nj, ni) flattened)."""
    return np.asarray(ds[name].values).reshape(-1)


# ---- transcriptions of the teams' code ------------------------------------------------------------------------


def select_data(mask, lat, aice, clean_data, pole):
    """IceEmul.h selectData (guillaumevernieres/daml src/daml/IceEmul/IceEmul.h), line for line; float32 values,
    as readCice reads them."""
    if pole == "north":
        if clean_data:
            if mask == 1 and lat > 40.0 and aice > 0.0 and aice <= 1.0:
                return True
            else:
                return False
        else:
            if lat > 60.0:
                return True
    if pole == "south":
        if clean_data:
            if mask == 1 and lat < -40.0 and aice > 0.0 and aice <= 1.0:
                return True
            else:
                return False
        else:
            if lat < -60.0:
                return True
    return False


def soca_select(mask, lat, aice, pole, i, clean=True):
    return select_data(mask[i], lat[i], aice[i], clean, pole)


def soca_cells(mask, lat, aice, pole, n, size, clean=True):
    """IceEmul.h prepData on `size` ranks: each counts its domain cells along i = rank, rank + size, ... up to n,
    MPI_MIN of the counts, then each takes that many; the union of every rank's cells."""
    local = []
    for rank in range(size):
        count = 0
        for i in range(rank, len(lat), size):
            if soca_select(mask, lat, aice, pole, i, clean):
                count += 1
            if count >= n:
                break
        local.append(count)
    num_patterns = min(local)
    cells = []
    for rank in range(size):
        cnt = 0
        for i in range(rank, len(lat), size):
            if soca_select(mask, lat, aice, pole, i, clean):
                cells.append(i)
                cnt += 1
            if cnt >= num_patterns:
                break
    return sorted(cells)


def c710abb_cells(mask, aice, max_patterns):
    """aibalance c710abb filter_data with select_data, mask_mode "sea_ice", min_ice 0.0."""
    selected = []
    for i in range(len(mask)):
        if float(mask[i]) != 1:
            continue
        if float(aice[i]) < 0.0:
            continue
        selected.append(i)
        if len(selected) >= max_patterns:
            break
    return selected


def b1eccbc_cells(ocean, atmos, max_patterns):
    """aibalance b1eccbc read_netcdf_data_pair and filter_data (mask_mode "sea_ice", min_ice 0.0)."""
    thick = ocean["sea_water_cell_thickness"].values[:, :, 0].astype(np.float32).flatten()
    tair_var = atmos["air_temperature"]
    tair = (tair_var.values[:, :, tair_var.shape[2] - 1] if tair_var.ndim == 3 else tair_var.values)
    tair = tair.astype(np.float32).flatten()
    aice = ocean["sea_ice_area_fraction"].values[:, :, 0].astype(np.float32).flatten()
    mask = ((thick > 0.0) & (thick <= 500.0) & (tair >= 183.15) & (tair <= 333.15)).astype(np.int32)
    valid = (mask == 1) & (aice > 0.0)
    return np.where(valid)[0][:max_patterns]


def c710abb_reader(filename, input_variables, output_variables=("aice",), min_ice=0.0, max_patterns=400000):
    """aibalance c710abb ufsemulator/data.py IceDataPreparer.read_netcdf_data and filter_data (mask_mode
    "sea_ice"), transcribed: every variable of var_names is read (with its alternative names; a KeyError when none
    is there), then the cells select_data keeps, in grid order, up to max_patterns: (patterns, targets) float32."""
    import netCDF4 as nc

    var_names = {"lat": "ULAT", "lon": "ULON", "aice": "aice_h", "tsfc": "Tsfc_h", "sst": "sst_h", "sss": "sss_h",
                 "sice": "sice_h", "hi": "hi_h", "hs": "hs_h", "mask": "umask", "tair": "Tair_h",
                 "frzmlt": "frzmlt_h", "strocnx": "strocnx_h", "strocny": "strocny_h", "strairx": "strairx_h",
                 "strairy": "strairy_h", "qref": "Qref_h", "flwdn": "flwdn_h", "fswdn": "fswdn_h", "uocn": "uocn_h",
                 "vocn": "vocn_h", "uatm": "uatm_h", "vatm": "vatm_h"}
    alt_var_names = {"aice_h": ["aicen", "aice", "ice_concentration"], "hi_h": ["hicen", "hi", "ice_thickness"],
                     "hs_h": ["hsnon", "hs", "snow_thickness"], "ULAT": ["lat", "latitude", "TLAT"],
                     "ULON": ["lon", "longitude", "TLON"], "umask": ["mask", "land_mask", "ocean_mask"],
                     "Tair_h": ["tair", "air_temperature"], "Tsfc_h": ["tsfc", "surface_temperature"],
                     "sst_h": ["sst", "sea_surface_temperature"], "sss_h": ["sss", "sea_surface_salinity"],
                     "sice_h": ["sice", "ice_salinity"], "frzmlt_h": ["frzmlt", "frazil_melt", "frazil_ice_melt"]}
    data = {}
    with nc.Dataset(filename, "r") as dataset:
        for key, var_name in var_names.items():
            found_var = None
            if var_name in dataset.variables:
                found_var = var_name
            else:
                alt_names = alt_var_names.get(var_name, [])
                for alt_name in alt_names:
                    if alt_name in dataset.variables:
                        found_var = alt_name
                        break
            if found_var:
                data[key] = dataset.variables[found_var][:].flatten()
            else:
                raise KeyError(f"Variable {var_name} (or alternatives {alt_names}) not found in {filename}.")
    selected_indices = []
    for i in range(len(data["lat"])):
        mask, aice = float(data["mask"][i]), float(data["aice"][i])
        if mask != 1:  # select_data, mask_mode "sea_ice"
            continue
        if aice < min_ice:
            continue
        selected_indices.append(i)
        if len(selected_indices) >= max_patterns:
            break
    patterns = np.zeros((len(selected_indices), len(input_variables)), dtype=np.float32)
    targets = np.zeros((len(selected_indices), len(output_variables)), dtype=np.float32)
    for cnt, idx in enumerate(selected_indices):
        for i, feature_name in enumerate(input_variables):
            patterns[cnt, i] = data[feature_name][idx] if feature_name in data else 0.0
        for i, target_name in enumerate(output_variables):
            targets[cnt, i] = data[target_name][idx] if target_name in data else 0.0
    return patterns, targets


def b1eccbc_reader(atm_file, ocn_file, input_variables, output_variables=("aice",), min_ice=0.0,
                   max_patterns=400000):
    """aibalance b1eccbc ufsemulator/data.py IceDataPreparer.read_netcdf_data_pair and filter_data (mask_mode
    "sea_ice"), transcribed with its cf_mappings.py: (patterns, targets) float32; an input it reads nothing for is
    `data.get(name, zeros)`."""
    import netCDF4 as nc

    cf_atm = {"lat": "latitude", "lon": "longitude", "tair": "air_temperature", "uatm": "eastward_wind",
              "vatm": "northward_wind", "tsfc": "skin_temperature_at_surface",
              "qref": "water_vapor_mixing_ratio_wrt_moist_air"}
    cf_ocn = {"sst": "sea_water_potential_temperature", "sss": "sea_water_salinity", "aice": "sea_ice_area_fraction",
              "hi": "sea_ice_thickness", "hs": "sea_ice_snow_thickness", "thick": "sea_water_cell_thickness"}
    da, do = nc.Dataset(atm_file, "r"), nc.Dataset(ocn_file, "r")
    data = {}
    lat = da.variables[cf_atm["lat"]][:].astype(np.float32)
    lon = da.variables[cf_atm["lon"]][:].astype(np.float32)
    data["lat"] = np.repeat(lat[:, None], lon.size, axis=1).flatten()
    data["lon"] = np.repeat(lon[None, :], lat.size, axis=0).flatten()
    tair_var = da.variables[cf_atm["tair"]]
    for key in ("tair", "uatm", "vatm", "tsfc", "qref"):
        values = da.variables[cf_atm[key]][:]
        if len(tair_var.shape) == 3:
            values = values[:, :, tair_var.shape[2] - 1]
        data[key] = values.astype(np.float32).flatten()
    for key in ("sst", "sss", "aice", "hi", "hs", "thick"):
        data[key] = do.variables[cf_ocn[key]][:][:, :, 0].astype(np.float32).flatten()
    data["mask"] = ((data["thick"] > 0.0) & (data["thick"] <= 500.0) &
                    (data["tair"] >= 183.15) & (data["tair"] <= 333.15)).astype(np.int32)
    da.close()
    do.close()
    valid = (data["mask"] == 1) & (data["aice"] > min_ice)
    indices = np.where(valid)[0][:max_patterns]
    patterns = np.zeros((len(indices), len(input_variables)), dtype=np.float32)
    targets = np.zeros((len(indices), len(output_variables)), dtype=np.float32)
    for j, name in enumerate(input_variables):
        patterns[:, j] = data.get(name, np.zeros(len(data["lat"]), dtype=np.float32))[indices]
    for j, name in enumerate(output_variables):
        targets[:, j] = data.get(name, np.zeros(len(data["lat"]), dtype=np.float32))[indices]
    return patterns, targets


def pattern_rows(*arrays):
    """Rows of [inputs, targets] as a sorted float64 array: the same set whatever the split into training and
    validation."""
    x = np.concatenate([np.asarray(a, dtype=np.float64) for a in arrays], axis=0)
    return x[np.lexsort(x.T[::-1])]


def ours(patterns):
    return pattern_rows(np.concatenate([patterns.train_inputs, patterns.train_targets], 1),
                        np.concatenate([patterns.valid_inputs, patterns.valid_targets], 1))


C710ABB_DEFAULT_INPUTS = ("sst", "sss", "tair", "tsfc", "hi", "hs", "sice", "strocnx", "strocny", "strairx", "strairy",
                          "qref", "flwdn", "fswdn")  # IceDataPreparer's default_inputs at c710abb


@pytest.mark.filterwarnings("ignore:Warning. converting a masked element to nan")  # c710abb's float() of land
@pytest.mark.parametrize("inputs", [DEFAULT_INPUTS, C710ABB_DEFAULT_INPUTS], ids=["config_aice", "its-defaults"])
def test_the_generated_cice_file_is_read_by_c710abbs_reader_as_we_read_it(inputs, tmp_path):
    """The generated CICE file carries every variable c710abb's reader reads (frzmlt_h, the stresses: a KeyError
    before), and --domain aibalance-c710abb gives its patterns, value for value."""
    synthesize(tmp_path / "cice.nc", seed=4, nlat=24, nlon=48, naming="cice")
    patterns, targets = c710abb_reader(tmp_path / "cice.nc", list(inputs))
    assert len(patterns) > 300 and all(patterns[:, k].std() > 0 for k in range(len(inputs)))
    loaded = load_patterns(Accelerator(cpu=True), tmp_path / "cice.nc", inputs=inputs, domain="aibalance-c710abb")
    assert np.array_equal(ours(loaded), pattern_rows(np.concatenate([patterns, targets], 1)))


def test_b1eccbc_trains_on_what_its_reader_gives_zeros_included(pair):
    """aibalance b1eccbc's reader gives sice, uocn, vocn, flwdn, fswdn as 0 though the pair holds them: so does
    --domain aibalance-b1eccbc (the same patterns, value for value), and says so."""
    ocean_path, atmos_path = pair
    patterns, targets = b1eccbc_reader(atmos_path, ocean_path, list(DEFAULT_INPUTS))
    zeroed = ["sice", "uocn", "vocn", "flwdn", "fswdn"]
    loaded = load_patterns(Accelerator(cpu=True), ocean_path, atmos_path=atmos_path, domain="aibalance-b1eccbc")
    assert np.array_equal(ours(loaded), pattern_rows(np.concatenate([patterns, targets], 1)))
    assert all(not patterns[:, DEFAULT_INPUTS.index(name)].any() for name in zeroed) and len(patterns) > 500
    with xr.open_dataset(ocean_path) as ocean, xr.open_dataset(atmos_path) as atmos:  # the files hold them
        assert float(ocean["sea_ice_salinity"][:, :, 0].max()) > 1 and float(atmos[
            "surface_downwelling_longwave_flux_in_air"].max()) > 100
    meta = loaded.meta
    assert meta["zeroed"] == zeroed and "sice" not in meta["variables"] and "sice<-0" in describe_variables(meta)
    assert describe_layout(meta)[0].startswith("zeroed: sice, uocn, vocn, flwdn, fswdn are 0 in every pattern, as "
                                               "--domain aibalance-b1eccbc's reader gives them")
    assert loaded.input_std[DEFAULT_INPUTS.index("sice")] == 1 and loaded.input_mean[DEFAULT_INPUTS.index("sice")] == 0
    plain = load_patterns(Accelerator(cpu=True), ocean_path, atmos_path=atmos_path, mask="thickness-tair",
                          min_abs_lat=0.0, open_water=False)  # ours reads them: other patterns, another fingerprint
    assert plain.meta["zeroed"] == [] and plain.fingerprint != loaded.fingerprint
    assert loaded.fingerprint.endswith("/zeroed=sice,uocn,vocn,flwdn,fswdn")
    with pytest.raises(UsageError, match="--variables sice=x: --domain aibalance-b1eccbc's reader reads no sice"):
        load_patterns(Accelerator(cpu=True), "/no/such.nc", domain="aibalance-b1eccbc", variables={"sice": "x"})


# ---- the domains against them -----------------------------------------------------------------------------------

NAMES = [CICE_NAMES[name] for name in [*DEFAULT_INPUTS, "aice"]]


def selected(ds, path, **flags):
    common = dict(names=NAMES, mask_variable="umask", lat_variable="ULAT", min_abs_lat=40.0, thin=1, max_patterns=0,
                  val_fraction=0.1, seed=0, ice_variable="aice_h")
    return select_patterns(ds, path, **(common | flags))


@pytest.mark.parametrize("pole", ["north", "south"])
@pytest.mark.parametrize("world, per_rank", [(1, 0), (1, 150), (3, 0), (3, 60)])
def test_soca_domain_is_socas_select_data_and_prepdata_cap(pole, world, per_rank, cice):
    with xr.open_dataset(cice) as ds:
        mask, lat, aice = flat(ds, "umask"), flat(ds, "ULAT"), flat(ds, "aice_h")
        expected = soca_cells(mask, lat, aice, pole, per_rank or len(lat), world)
        selection = selected(ds, cice, domain="soca", hemisphere=pole, max_patterns_per_rank=per_rank, world=world)
        domain = sum(soca_select(mask, lat, aice, pole, i) for i in range(len(lat)))
        polar = (mask == 1) & (lat > 40.0 if pole == "north" else lat < -40.0)
        assert (aice[polar] == 0).sum() > 20 and (aice[polar] < 0).any()  # open water and noise below 0 in its mask
    assert selection.domain_cells == domain > 50
    assert selection.cells.tolist() == expected
    assert len(expected) < domain if per_rank or world > 1 else len(expected) == domain  # the cap or MPI_MIN cut
    assert selection.depends_on_world
    assert selection.where == {"north": "umask == 1 and ULAT > 40 and 0 < aice_h <= 1",
                               "south": "umask == 1 and ULAT < -40 and 0 < aice_h <= 1"}[pole]


@pytest.mark.parametrize("pole", ["north", "south"])
@pytest.mark.parametrize("world, per_rank", [(1, 0), (3, 40)])
def test_soca_unclean_is_select_data_without_clean_data(pole, world, per_rank, cice):
    """SOCA's clean data: false: every cell beyond 60 degrees, land (mask 0, aice NaN) and open water included."""
    with xr.open_dataset(cice) as ds:
        mask, lat, aice = flat(ds, "umask"), flat(ds, "ULAT"), flat(ds, "aice_h")
        expected = soca_cells(mask, lat, aice, pole, per_rank or len(lat), world, clean=False)
        selection = selected(ds, cice, domain="soca-unclean", mask_variable="", hemisphere=pole,
                             max_patterns_per_rank=per_rank, world=world)
        domain = [i for i in range(len(lat)) if soca_select(mask, lat, aice, pole, i, clean=False)]
    assert selection.cells.tolist() == expected and selection.domain_cells == len(domain) > 300
    assert (mask[domain] == 0).any() and np.isnan(aice[domain]).any() and (aice[domain] == 0).any()
    assert selection.where == {"north": "ULAT > 60", "south": "ULAT < -60"}[pole] and selection.depends_on_world


def test_soca_unclean_trains_only_where_the_file_has_values(cice, tmp_path):
    """Its land cells hold the file's fill (NaN here): one line naming the count and the domain; a file with values
    there trains, its selection recorded as SOCA's."""
    accelerator = Accelerator(cpu=True)
    with pytest.raises(UsageError, match=r"NaN/inf values inside the sea-ice domain .*--domain soca-unclean keeps "
                                         r"every cell of its latitudes, land too") as error:
        load_patterns(accelerator, cice, domain="soca-unclean", hemisphere="north")
    assert "\n" not in str(error.value)
    with xr.open_dataset(cice) as ds:
        filled = ds.load()
    for name in filled.data_vars:
        if filled[name].ndim == 3:  # the fields: land given each field's median
            filled[name] = filled[name].fillna(float(filled[name].median()))
    filled.to_netcdf(tmp_path / "filled.nc", engine="netcdf4")
    patterns = load_patterns(accelerator, tmp_path / "filled.nc", domain="soca-unclean", hemisphere="south")
    assert patterns.meta["where"] == "ULAT < -60" and patterns.meta["mask_variable"] == ""
    with xr.open_dataset(cice) as ds:
        mask, lat, aice = flat(ds, "umask"), flat(ds, "ULAT"), flat(ds, "aice_h")
        assert patterns.meta["patterns"] == len(soca_cells(mask, lat, aice, "south", len(lat), 1, clean=False))


@pytest.mark.parametrize("cap", [0, 700])
def test_aibalance_c710abb_domain_is_its_select_data_and_first_n(cap, cice):
    with xr.open_dataset(cice) as ds:
        mask, aice = flat(ds, "umask"), flat(ds, "aice_h")
        expected = c710abb_cells(mask, aice, cap or len(mask))
        selection = selected(ds, cice, domain="aibalance-c710abb", lat_variable="", max_patterns=cap)
        assert (aice[mask == 1] < 0).any() and (aice[mask == 1] > 1).any()  # the noise crosses both bounds
    assert selection.domain_cells == len(c710abb_cells(mask, aice, len(mask)))
    assert selection.cells.tolist() == expected and not selection.depends_on_world
    if cap:  # the FIRST cap cells in grid order, not a subset spread over the domain
        assert selection.cells.tolist() == c710abb_cells(mask, aice, len(mask))[:cap]


def test_aibalance_b1eccbc_domain_is_its_mask_on_the_cf_pair(pair):
    ocean_path, atmos_path = pair
    with open_fields(ocean_path, atmos_path, domain="aibalance-b1eccbc", need_lat=False) as fields:
        names = [*DEFAULT_INPUTS, "aice"]
        every = select_patterns(fields.view, fields.label, names=names, mask_variable=fields.mask_key, lat_variable="",
                                min_abs_lat=40.0, thin=1, max_patterns=0, val_fraction=0.1, seed=0,
                                domain="aibalance-b1eccbc")
        first = select_patterns(fields.view, fields.label, names=names, mask_variable="", lat_variable="",
                                min_abs_lat=40.0, thin=1, max_patterns=500, val_fraction=0.1, seed=0,
                                domain="aibalance-b1eccbc")
    with xr.open_dataset(ocean_path) as ocean, xr.open_dataset(atmos_path) as atmos:
        assert every.cells.tolist() == b1eccbc_cells(ocean, atmos, 10**9).tolist()
        assert first.cells.tolist() == b1eccbc_cells(ocean, atmos, 500).tolist()
    assert every.where == "0 < thick <= 500 and 183.15 <= tair <= 333.15 and aice > 0"


def test_toolkit_domain_is_unchanged_and_counts_differ_by_team(cice):
    """Ours: tmask > 0.5 and |TLAT| >= 40 (open water in); the teams' counts on the same file differ from it."""
    with xr.open_dataset(cice) as ds:
        ours = selected(ds, cice, mask_variable="tmask", lat_variable="TLAT", ice_variable="")
        expected = (flat(ds, "tmask") > 0.5) & (np.abs(flat(ds, "TLAT")) >= 40)
        counts = {"soca": sum(selected(ds, cice, domain="soca", hemisphere=h).domain_cells for h in ("north", "south")),
                  "aibalance-c710abb": selected(ds, cice, domain="aibalance-c710abb").domain_cells}
    assert ours.cells.tolist() == np.flatnonzero(expected).tolist() and ours.where == "tmask > 0.5 and |TLAT| >= 40.0"
    assert len({ours.domain_cells, *counts.values()}) == 3


def test_a_team_domain_trains_from_load_patterns_and_predict_gets_it_from_the_config(cice):
    accelerator = Accelerator(cpu=True)
    patterns = load_patterns(accelerator, cice, domain="soca", hemisphere="north", seed=1)
    meta = patterns.meta
    assert (meta["domain"], meta["mask_variable"], meta["lat_variable"]) == ("soca", "umask", "ULAT")
    assert meta["where"] == "umask == 1 and ULAT > 40 and 0 < aice <= 1"
    assert patterns.train_targets.min() > 0 and patterns.train_targets.max() <= 1
    config = {"domain": "soca", "hemisphere": "north", "mask": "variable", "mask_variable": "auto",
              "lat_variable": "auto", "min_abs_lat": 40.0}
    options = selection_options({"domain": {"mask_variable": "umask", "lat_variable": "ULAT"}, "config": config})
    assert {key: options[key] for key in ("domain", "mask", "mask_variable", "lat_variable", "min_abs_lat",
                                          "hemisphere")} == {"domain": "soca", "mask": "variable", "mask_variable":
                                                             "umask", "lat_variable": "ULAT", "min_abs_lat": 40.0,
                                                             "hemisphere": "north"}
    with xr.open_dataset(cice) as ds:  # predict's call: every cell of the training's domain, no cap
        again = select_patterns(ds, cice, names=NAMES, ice_variable="aice_h", **options)
    assert again.domain_cells == meta["domain_cells"] == len(again.cells)


# ---- flags a team's domain fixes: one line, before any file is read ----------------------------------------------

REFUSED = {
    "soca without a pole": ({"domain": "soca"}, "--domain soca trains one model per pole, as SOCA does: give "
                            "--hemisphere north or south"),
    "soca with a total cap": ({"domain": "soca", "hemisphere": "north", "max_patterns": 100},
                              "--max-patterns 100: SOCA caps each rank"),
    "soca with another latitude bound": ({"domain": "soca", "hemisphere": "south", "min_abs_lat": 60.0},
                                         "--min-abs-lat 60: --domain soca selects as the team does"),
    "c710abb with a hemisphere": ({"domain": "aibalance-c710abb", "hemisphere": "north"},
                                  "--hemisphere north: --domain aibalance-c710abb selects as the team does"),
    "c710abb with a cap per rank": ({"domain": "aibalance-c710abb", "max_patterns_per_rank": 10},
                                    "--max-patterns-per-rank 10: aibalance caps the whole domain"),
    "c710abb without open water": ({"domain": "aibalance-c710abb", "open_water": False}, "--no-open-water: "),
    "b1eccbc with a mask variable": ({"domain": "aibalance-b1eccbc", "mask_variable": "umask"},
                                     "--mask-variable umask: the thickness-tair mask"),
    "thickness-tair with a mask variable": ({"mask": "thickness-tair", "mask_variable": "tmask"},
                                            "--mask-variable tmask: the thickness-tair mask"),
    "soca with the thickness-tair mask": ({"domain": "soca", "hemisphere": "north", "mask": "thickness-tair"},
                                          "--mask thickness-tair: --domain soca selects as the team does"),
    "soca without a mask variable": ({"domain": "soca", "hemisphere": "north", "mask_variable": ""},
                                     "--mask-variable '': --domain soca selects as the team does"),
    "soca-unclean without a pole": ({"domain": "soca-unclean"}, "--domain soca-unclean trains one model per pole"),
    "soca-unclean with a mask variable": ({"domain": "soca-unclean", "hemisphere": "north", "mask_variable": "umask"},
                                          "--mask-variable 'umask': --domain soca-unclean selects as the team does"),
    "soca-unclean with open water out": ({"domain": "soca-unclean", "hemisphere": "north", "open_water": False},
                                         "--no-open-water: --domain soca-unclean selects as the team does"),
    "an unknown domain": ({"domain": "nasa"}, "--domain nasa is invalid; give one of toolkit, soca, soca-unclean, "
                          "aibalance-c710abb, aibalance-b1eccbc"),
}


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("ufs_emulator", "ufs_domains_recipe")


@pytest.mark.parametrize("case", list(REFUSED))
def test_flags_a_team_domain_fixes_are_one_line_before_any_file_is_read(case, recipe):
    flags, fragment = REFUSED[case]
    with pytest.raises(UsageError) as error:  # no such file: the flags are refused first
        load_patterns(Accelerator(cpu=True), "/no/such.nc", **flags)
    assert "\n" not in str(error.value) and fragment in str(error.value), str(error.value)
    if case != "an unknown domain":  # the recipe's check, at parse time (tyro refuses an unknown choice itself)
        config = dataclasses.replace(recipe.PRESETS["cpu"][1], data=Path("/no/such.nc"), **flags)
        with pytest.raises(UsageError, match=re.escape(fragment)):
            recipe.check(config)


def test_gdas_preset_follows_aibalance_c710abb(recipe):
    gdas = recipe.PRESETS["gdas"][1]
    assert (gdas.domain, gdas.max_patterns, gdas.max_patterns_per_rank) == ("aibalance-c710abb", 400_000, 0)
    assert (gdas.epochs, gdas.patience, gdas.min_epochs, gdas.stop_early) == (100_000, 50, 3_000, False)
    assert "c710abb" in recipe.PRESETS["gdas"][0] and set(DOMAINS) == {
        "toolkit", "soca", "soca-unclean", "aibalance-c710abb", "aibalance-b1eccbc"}
