"""UFS emulator data: the generator's file (fields, units, noise of the recorded sigma), the sea-ice domain, cap and
thin, the strided sharding (statistics and patterns independent of it, also in a real 2-process gloo run, and
accurate for temperatures near 273 K where sqrt(E[x^2] - mean^2) is not), real CICE files (CICE history and CF
names, explicit names, an atmosphere file beside the ocean one, umask/ULAT, hemisphere, open water, a cap per rank),
and one-line errors for bad files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import xarray as xr
from accelerate import Accelerator
from conftest import ROOT, ranks_seen, run_recipe

from toolkit.data.ufs import (
    ATMOSPHERE_FIELDS,
    CICE_NAMES,
    DEFAULT_INPUTS,
    FIELDS,
    assemble_strided,
    clean_aice,
    describe_variables,
    load_patterns,
    open_dataset,
    read_shard,
    select_patterns,
    synthesize,
)
from toolkit.errors import UsageError
from toolkit.run.distributed import combine_moments, local_moments, std_from_moments


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("ufs") / "grid.nc", seed=3, nlat=60, nlon=120, sigma=0.05)


def two_pass(x: np.ndarray):
    """float64 mean and population std per column, two-pass (the reference)."""
    columns = np.ascontiguousarray(np.asarray(x, dtype=np.float64).T)
    mean = columns.sum(axis=1) / columns.shape[1]
    deviation = columns - mean[:, None]
    return mean, np.sqrt((deviation * deviation).sum(axis=1) / columns.shape[1])


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


def test_generated_file_has_the_fields_units_and_noise_it_says(grid_file):
    ds = xr.open_dataset(grid_file, engine="netcdf4")
    assert set(DEFAULT_INPUTS) | {"aice", "tmask", "TLAT", "TLON"} <= set(ds.variables)
    assert ds["sst"].attrs["units"] == "K" and ds["uatm"].attrs["units"] == "m/s" and ds["hi"].attrs["units"] == "m"
    assert ds["sst"].dims == ("time", "nj", "ni") and ds["sst"].shape == (1, 60, 120)
    sigma = float(ds.attrs["noise_sigma"])
    assert sigma == 0.05 and "sigmoid" in ds.attrs["aice_formula"]
    ocean = ds["tmask"].values > 0.5
    values = {name: ds[name].values[0][ocean].astype(np.float64) for name in FIELDS}
    assert np.isnan(ds["sst"].values[0][~ocean]).all()  # land is fill, as in model output
    assert 271.0 < values["sst"].min() and values["sst"].max() < 300.0
    assert values["hi"].min() >= 0 and values["fswdn"].min() >= 0 and 0 < values["qref"].max() < 0.03
    # aice minus the known clean function is the noise: its std is the recorded sigma (float32 storage aside)
    residual = ds["aice"].values[0][ocean].astype(np.float64) - clean_aice(values)
    assert abs(residual.mean()) < 0.005 and abs(residual.std() / sigma - 1) < 0.05


def test_patterns_cover_the_domain_and_statistics_equal_the_float64_reference(grid_file, accelerator):
    patterns = load_patterns(accelerator, grid_file, seed=1)
    meta = patterns.meta
    ds = xr.open_dataset(grid_file)
    domain = (ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40)
    assert meta["domain_cells"] == meta["patterns"] == int(domain.sum())
    assert meta["train_patterns"] + meta["valid_patterns"] == meta["patterns"]
    assert 0.05 < meta["valid_patterns"] / meta["patterns"] < 0.15
    assert torch.isfinite(patterns.train_inputs).all() and patterns.train_inputs.dtype == torch.float64
    mean, std = two_pass(torch.cat([patterns.train_inputs, patterns.train_targets], dim=1).numpy())
    assert relative(torch.cat([patterns.input_mean, patterns.output_mean]), mean) < 1e-12
    assert relative(torch.cat([patterns.input_std, patterns.output_std]), std) < 1e-12
    # the same selection with another seed is another validation split, the same domain
    other = load_patterns(accelerator, grid_file, seed=2)
    assert other.meta["patterns"] == meta["patterns"] and not torch.equal(other.valid_targets, patterns.valid_targets)


def test_thin_and_cap(grid_file):
    with open_dataset(grid_file) as ds:
        names = [*DEFAULT_INPUTS, "aice"]
        common = dict(
            names=names, mask_variable="tmask", lat_variable="TLAT", min_abs_lat=40.0, val_fraction=0.1, seed=0
        )
        every = select_patterns(ds, grid_file, thin=1, max_patterns=0, **common)
        thinned = select_patterns(ds, grid_file, thin=3, max_patterns=0, **common)
        capped = select_patterns(ds, grid_file, thin=1, max_patterns=500, **common)
    assert np.array_equal(thinned.cells, every.cells[::3])
    assert len(capped.cells) == 500 and np.isin(capped.cells, every.cells).all()
    assert np.all(np.diff(capped.cells) > 0)  # kept in grid order
    assert capped.cells.min() < every.cells[len(every.cells) // 2] < capped.cells.max()  # spread, not the first 500


@pytest.mark.parametrize("world", [2, 3, 5])
def test_sharding_changes_neither_the_patterns_nor_the_statistics(grid_file, world):
    with open_dataset(grid_file) as ds:
        names = [*DEFAULT_INPUTS, "aice"]
        selection = select_patterns(
            ds,
            grid_file,
            names=names,
            mask_variable="tmask",
            lat_variable="TLAT",
            min_abs_lat=40.0,
            thin=1,
            max_patterns=0,
            val_fraction=0.1,
            seed=0,
        )
        whole = torch.from_numpy(read_shard(ds, grid_file, names, selection.cells, 0, 1))
        shards = [torch.from_numpy(read_shard(ds, grid_file, names, selection.cells, r, world)) for r in range(world)]
    assert [len(s) for s in shards] == [len(range(r, len(selection.cells), world)) for r in range(world)]
    assert torch.equal(assemble_strided(shards), whole)  # the same patterns, in the same order, bit for bit
    train = [s[~torch.from_numpy(selection.is_valid[r::world])] for r, s in enumerate(shards)]
    count, mean, _, m2 = combine_moments(torch.stack([local_moments(t) for t in train]))
    reference_mean, reference_std = two_pass(whole[~torch.from_numpy(selection.is_valid)].numpy())
    assert relative(mean, reference_mean) < 1e-12
    assert relative(std_from_moments(count, m2), reference_std) < 1e-12


# ---- bad files: one UsageError line naming the file and what is wrong ----------------------------------------


def _edited(source, target, edit):
    ds = xr.open_dataset(source, engine="netcdf4").load()
    edit(ds)
    ds.to_netcdf(target, engine="netcdf4")
    return target


def test_missing_file_and_missing_variable_are_named(grid_file, accelerator, tmp_path):
    with pytest.raises(UsageError, match="/no/such.nc does not exist"):
        load_patterns(accelerator, "/no/such.nc")
    with pytest.raises(UsageError, match=r"grid.nc has no input variable 'salty'"):
        load_patterns(accelerator, grid_file, inputs=["sst", "salty"])
    without_mask = _edited(grid_file, tmp_path / "nomask.nc", lambda ds: ds.__delitem__("tmask"))
    with pytest.raises(UsageError, match=r"nomask.nc has no mask .*'tmask'"):
        load_patterns(accelerator, without_mask)
    text = tmp_path / "notes.nc"
    text.write_text("not netCDF")
    with pytest.raises(UsageError, match="notes.nc is not a readable netCDF file"):
        load_patterns(accelerator, text)


def test_all_masked_domain_and_nans_are_refused_with_their_count(grid_file, accelerator, tmp_path):
    with pytest.raises(UsageError, match="the sea-ice domain is empty"):
        load_patterns(accelerator, grid_file, min_abs_lat=90.0)

    def poke_nans(ds):
        inside = np.flatnonzero(((ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40)).ravel())[:7]
        values = ds["hi"].values.copy()
        values[0].ravel()[inside] = np.nan
        values[0] = values[0].reshape(values.shape[1:])
        ds["hi"] = (ds["hi"].dims, values, ds["hi"].attrs)

    holes = _edited(grid_file, tmp_path / "holes.nc", poke_nans)
    with pytest.raises(UsageError, match=r"holes.nc: input field 'hi' has 7 NaN/inf values inside the sea-ice"):
        load_patterns(accelerator, holes)


def test_generator_cli(tmp_path):
    out = tmp_path / "small.nc"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.data.ufs",
            "synth",
            "--out",
            str(out),
            "--nlat",
            "8",
            "--nlon",
            "16",
            "--seed",
            "4",
            "--sigma",
            "0.1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    ds = xr.open_dataset(out)
    assert ds["aice"].shape == (1, 8, 16) and float(ds.attrs["noise_sigma"]) == 0.1 and int(ds.attrs["seed"]) == 4
    bad = subprocess.run(
        [sys.executable, "-m", "toolkit.data.ufs", "synth", "--out", str(tmp_path / "x.nc"), "--sigma", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --sigma -1.0 is invalid; give a finite standard deviation >= 0"
    ]
    assert not (tmp_path / "x.nc").exists()


# ---- a real 2-process gloo run: each rank reads its share; the merged statistics equal 1-process ones ----------

STATS_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from accelerate import Accelerator
    from toolkit.data.ufs import load_patterns
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    os.write(2, f"[rank {rank}/{world}]\\n".encode())  # one write: the ranks' lines do not interleave
    p = load_patterns(accelerator, sys.argv[1], max_patterns=int(sys.argv[3]))
    out = {"world": world, "shard_rows": len(range(rank, p.meta["patterns"], world)),
           "mean": torch.cat([p.input_mean, p.output_mean]).tolist(),
           "std": torch.cat([p.input_std, p.output_std]).tolist(),
           "train": torch.cat([p.train_inputs, p.train_targets], 1).tolist()}
    with open(f"{sys.argv[2]}.{rank}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.fixture(scope="module")
def cold_file(grid_file, tmp_path_factory):
    """tair near 273.15 K with a spread of 1e-4 K (a few float32 ulps): float64 E[x^2] - mean^2 loses digits."""

    def freeze(ds):
        rng = np.random.default_rng(0)
        values = 273.15 + 1e-4 * rng.standard_normal(ds["tair"].shape)
        ds["tair"] = (ds["tair"].dims, values.astype(np.float32), ds["tair"].attrs)

    return _edited(grid_file, tmp_path_factory.mktemp("cold") / "cold.nc", freeze)


@pytest.fixture(scope="module")
def two_process_stats(cold_file, tmp_path_factory):
    where = tmp_path_factory.mktemp("stats")
    script = where / "stats.py"
    script.write_text(STATS_SCRIPT)
    result = run_recipe(
        [str(cold_file), str(where / "out"), "1001"],
        recipe=str(script),
        config="cpu_2proc.yaml",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert ranks_seen(result.stderr) == {(0, 2), (1, 2)}
    return [json.loads((where / f"out.{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_processes_read_their_shares_and_merge_to_the_one_process_statistics(
    two_process_stats, cold_file, accelerator
):
    ranks = two_process_stats
    assert [r["world"] for r in ranks] == [2, 2] and [r["shard_rows"] for r in ranks] == [501, 500]
    single = load_patterns(accelerator, cold_file, max_patterns=1001)
    mean = torch.cat([single.input_mean, single.output_mean]).numpy()
    std = torch.cat([single.input_std, single.output_std]).numpy()
    for rank in ranks:
        assert relative(rank["mean"], mean) < 1e-12 and relative(rank["std"], std) < 1e-12
        # training does not depend on the sharding: every rank holds the 1-process training patterns
        assert torch.equal(
            torch.tensor(rank["train"], dtype=torch.float64), torch.cat([single.train_inputs, single.train_targets], 1)
        )


@pytest.mark.slow
def test_temperatures_near_273_k_are_exact_where_the_naive_formula_is_not(two_process_stats, cold_file, accelerator):
    single = load_patterns(accelerator, cold_file, max_patterns=1001)
    tair = DEFAULT_INPUTS.index("tair")
    values = single.train_inputs[:, tair].numpy()  # the float32 file values, exactly, in float64
    _, reference = two_pass(values[:, None])
    naive = np.sqrt(np.mean(values * values) - np.mean(values) ** 2)  # float64, one pass
    assert relative(naive, reference) > 1e-6  # the formula the seeds used is visibly off here ...
    for rank in two_process_stats:  # ... the merged (count, mean, M2) of the 2-process run is not
        assert relative(rank["std"][tair], reference) < 1e-12
        assert 5e-5 < rank["std"][tair] < 2e-4


def _domain(ds):
    return ((ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40)).ravel()


def _set_inside(ds, name, value, count=None):
    inside = np.flatnonzero(_domain(ds))[:count]
    values = ds[name].values.copy()
    flat = values.reshape(values.shape[0], -1) if values.ndim == 3 else values.reshape(1, -1)
    flat[0, inside] = value
    ds[name] = (ds[name].dims, flat.reshape(values.shape), ds[name].attrs)
    ds[name].encoding["_FillValue"] = None  # no _FillValue attribute: nothing decodes the fill to NaN


def _fill_declared(ds, name, count):
    """Cells holding the variable's declared _FillValue: xarray decodes them to NaN, as a CICE file's land is."""
    _set_inside(ds, name, np.float32(-999.0), count)
    ds[name].encoding["_FillValue"] = np.float32(-999.0)


def _one_point_domain(ds):
    mask = np.zeros_like(ds["tmask"].values)
    mask.ravel()[np.flatnonzero(_domain(ds))[0]] = 1
    ds["tmask"] = (ds["tmask"].dims, mask, ds["tmask"].attrs)


HOSTILE_NETCDF = {
    "mask of another shape": (lambda ds: ds.__setitem__("tmask", (("a", "b"), np.ones((3, 4), np.float32))),
                              {}, "mask 'tmask' has grid (3, 4), the fields (60, 120)"),
    "constant output": (lambda ds: ds.__setitem__("aice", (ds["aice"].dims, np.full(ds["aice"].shape, 0.5,
                                                                                     np.float32))),
                        {}, "output field 'aice' is 0.5 at every training pattern"),
    "a field of strings": (lambda ds: ds.__setitem__("hs", (ds["hs"].dims, ds["hs"].values.astype(str))),
                           {}, "variable 'hs' holds <U"),
    "netCDF default fill inside the domain": (lambda ds: _set_inside(ds, "sst", np.float32(9.969209968386869e36), 5),
                                              {}, "field 'sst' holds netCDF's default fill value (about 9.97e36) at 5"),
    "sst in Celsius under units K": (lambda ds: _set_inside(ds, "sst", np.float32(-1.5), 3), {},
                                     "field 'sst' (K) has 3 values outside 150 .. 350"),
    "aice of 2": (lambda ds: _set_inside(ds, "aice", np.float32(2.0), 4), {},
                  "field 'aice' (1) has 4 values outside -0.25 .. 1.25"),
    "a wind of 1e4 m/s": (lambda ds: _set_inside(ds, "uatm", np.float32(1e4), 1), {}, "--range-factor"),
    "negative ice thickness": (lambda ds: _set_inside(ds, "hi", np.float32(-2.0), 6), {},
                               "field 'hi' (m) has 6 values outside 0 .. 50"),
    "humidity of 5 kg/kg": (lambda ds: _set_inside(ds, "qref", np.float32(5.0), 2), {},
                            "field 'qref' (kg/kg) has 2 values outside 0 .. 0.1"),
    "shortwave of 1e5 W/m^2": (lambda ds: _set_inside(ds, "fswdn", np.float32(1e5), 1), {},
                               "field 'fswdn' (W/m^2) has 1 values outside"),
    "infinite wind": (lambda ds: _set_inside(ds, "vatm", np.float32(np.inf), 2), {},
                      "input field 'vatm' has 2 NaN/inf values"),
    "NaN in the output": (lambda ds: _set_inside(ds, "aice", np.float32(np.nan), 3), {},
                          "output field 'aice' has 3 NaN/inf values"),
    "a 1-D field": (lambda ds: ds.__setitem__("sss", (("k",), np.ones(5, np.float32))), {},
                    "variable 'sss' has dimensions"),
    "a field on another grid": (lambda ds: ds.__setitem__("sss", (("a", "b"), np.ones((4, 4), np.float32))), {},
                                "variable 'sss' has grid (4, 4)"),
    "latitude on another grid": (lambda ds: ds.__setitem__("TLAT", (("a", "b"), np.ones((4, 4), np.float32))), {},
                                 "latitude 'TLAT' has grid (4, 4)"),
    "a mask of strings": (lambda ds: ds.__setitem__("tmask", (ds["tmask"].dims, ds["tmask"].values.astype(str))),
                          {}, "mask 'tmask' holds <U"),
    "only land": (lambda ds: ds.__setitem__("tmask", (ds["tmask"].dims, np.zeros(ds["tmask"].shape, np.float32))),
                  {}, "the sea-ice domain is empty"),
    "no latitude": (lambda ds: ds.__delitem__("TLAT"), {}, "has no latitude"),
    "no output": (lambda ds: ds.__delitem__("aice"), {}, "has no output variable 'aice'"),
    "fill value inside the domain, _FillValue set": (lambda ds: _fill_declared(ds, "sst", 4), {},
                                                      "input field 'sst' has 4 NaN/inf values"),
    "air at 1000 K": (lambda ds: _set_inside(ds, "tair", np.float32(1000.0), 1), {},
                      "field 'tair' (K) has 1 values outside 150 .. 350"),
    "latitude of strings": (lambda ds: ds.__setitem__("TLAT", (ds["TLAT"].dims, ds["TLAT"].values.astype(str))),
                            {}, "latitude 'TLAT' holds <U"),
    "salinity NaN everywhere": (lambda ds: ds.__setitem__("sss", (ds["sss"].dims, np.full(ds["sss"].shape, np.nan,
                                                                                          np.float32))),
                                {}, "input field 'sss' has"),
    "one-point domain": (_one_point_domain, {}, "no validation patterns (1 patterns"),
    "thin beyond the domain": (_one_point_domain, {"thin": 50}, "no validation patterns"),
    "max-patterns 1": (lambda ds: None, {"max_patterns": 1}, "no validation patterns (1 patterns"),
}


def test_a_wider_range_or_none_accepts_what_the_default_refuses(grid_file, accelerator, tmp_path):
    path = _edited(grid_file, tmp_path / "warm.nc", lambda ds: _set_inside(ds, "tair", np.float32(360.0), 2))
    with pytest.raises(UsageError, match="'tair' \\(K\\) has 2 values outside 150 .. 350"):
        load_patterns(accelerator, path)
    assert load_patterns(accelerator, path, range_factor=2.0).meta["patterns"] > 0
    assert load_patterns(accelerator, path, range_factor=0).meta["patterns"] > 0


# ---- real CICE files: names, two files, the teams' domain selection -----------------------------------------


@pytest.fixture(scope="module")
def cice_files(tmp_path_factory):
    """The grid_file's values under CICE history names, the atmospheric fields in a second file."""
    where = tmp_path_factory.mktemp("cice")
    ocean = synthesize(where / "ocean.nc", seed=3, nlat=60, nlon=120, sigma=0.05, naming="cice",
                       atmos_out=where / "atmos.nc")
    return ocean, where / "atmos.nc"


def test_cice_names_in_two_files_give_the_patterns_of_one_file_with_our_names(cice_files, grid_file, accelerator):
    ocean, atmos = cice_files
    with xr.open_dataset(ocean) as o, xr.open_dataset(atmos) as a:
        assert {"sst_h", "aice_h", "Tsfc_h", "tmask", "umask", "TLAT", "ULAT"} <= set(o.variables)
        assert {CICE_NAMES[n] for n in ATMOSPHERE_FIELDS} <= set(a.variables) and "Tair_h" not in o.variables
        assert not set(o.variables) & {"sst", "aice", "tair"}
    ours = load_patterns(accelerator, grid_file, seed=1)
    cice = load_patterns(accelerator, ocean, atmos_path=atmos, seed=1)
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets", "input_mean", "input_std"):
        assert torch.equal(getattr(ours, name), getattr(cice, name)), name
    assert describe_variables(cice.meta) == (
        "variables: sst<-sst_h, sss<-sss_h, tair<-Tair_h, tsfc<-Tsfc_h, hi<-hi_h, hs<-hs_h, sice<-sice_h, "
        "uocn<-uocn_h, vocn<-vocn_h, uatm<-uatm_h, vatm<-vatm_h, qref<-Qref_h, flwdn<-flwdn_h, fswdn<-fswdn_h, "
        "aice<-aice_h, mask<-tmask, lat<-TLAT; from --data-atmos: tair, uatm, vatm, qref, flwdn, fswdn"
    )
    assert describe_variables(ours.meta).startswith("variables: sst<-sst, sss<-sss,")


def test_cf_standard_names_and_explicit_names_are_found(grid_file, accelerator, tmp_path):
    def rename(ds):
        ds["SST_x"] = ds["sst"].assign_attrs(standard_name="sea_surface_temperature")  # found by standard_name
        ds["sea_ice_area_fraction"] = ds["aice"]  # found by the CF name as a variable name
        ds["T2m"] = ds["tair"]  # only found when named
        ds["latitude"] = ds["TLAT"]
        for name in ("sst", "aice", "tair", "TLAT"):
            del ds[name]

    path = _edited(grid_file, tmp_path / "cf.nc", rename)
    with pytest.raises(UsageError, match=r"cf.nc has no input variable 'tair' \(nor 'Tair_h', 'air_temperature'"):
        load_patterns(accelerator, path)
    found = load_patterns(accelerator, path, variables={"tair": "T2m"}, seed=1)
    assert found.meta["variables"] | {"lat": found.meta["lat_variable"]} == {
        **{name: name for name in [*DEFAULT_INPUTS, "aice"]},
        "sst": "SST_x", "tair": "T2m", "aice": "sea_ice_area_fraction", "lat": "latitude",
    }
    ours = load_patterns(accelerator, grid_file, seed=1)
    assert torch.equal(found.train_inputs, ours.train_inputs) and torch.equal(found.valid_targets, ours.valid_targets)


def _counted_domain(ds, mask, lat, poleward, ice=None):
    """The domain as the teams' select_data draws it, counted straight from the file."""
    lat = ds[lat].values
    keep = (ds[mask].values == 1) & ({"both": np.abs(lat), "north": lat, "south": -lat}[poleward] >= 40)
    if ice is not None:
        keep &= np.nan_to_num(ds[ice].values[0]) > 0
    return int(keep.sum())


@pytest.mark.parametrize(
    "flags, mask, lat, hemisphere, ice",
    [
        ({}, "tmask", "TLAT", "both", None),
        ({"mask_variable": "umask"}, "umask", "ULAT", "both", None),
        ({"mask_variable": "umask", "hemisphere": "north"}, "umask", "ULAT", "north", None),
        ({"hemisphere": "south", "open_water": False}, "tmask", "TLAT", "south", "aice_h"),
    ],
    ids=["tmask-both", "umask-ULAT", "umask-north", "south-no-open-water"],
)
def test_domain_selection_as_the_teams_draw_it(flags, mask, lat, hemisphere, ice, cice_files, accelerator, tmp_path):
    ocean, atmos = cice_files

    def open_water(ds):  # a third of the southern domain without ice
        values = ds["aice_h"].values.copy()
        values[0][(ds["TLAT"].values < -40) & (np.arange(values.shape[2]) % 3 == 0)] = 0.0
        ds["aice_h"] = (ds["aice_h"].dims, values, ds["aice_h"].attrs)

    ocean = _edited(ocean, tmp_path / "ocean.nc", open_water)
    patterns = load_patterns(accelerator, ocean, atmos_path=atmos, **flags)
    ds = xr.open_dataset(ocean)
    assert (patterns.meta["mask_variable"], patterns.meta["lat_variable"]) == (mask, lat)
    assert patterns.meta["domain_cells"] == patterns.meta["patterns"] == _counted_domain(ds, mask, lat, hemisphere, ice)
    assert patterns.meta["patterns"] > 100
    if ice:
        assert _counted_domain(ds, mask, lat, hemisphere) > patterns.meta["patterns"]  # open water was there
        assert patterns.train_targets.min() > 0


def test_cap_per_rank_is_the_cap_times_the_processes(grid_file, accelerator):
    per_rank = load_patterns(accelerator, grid_file, max_patterns_per_rank=300)
    total = load_patterns(accelerator, grid_file, max_patterns=300)
    assert per_rank.meta["patterns"] == per_rank.meta["max_patterns"] == 300  # 1 process here
    assert torch.equal(per_rank.train_inputs, total.train_inputs)
    assert load_patterns(accelerator, grid_file, max_patterns=200, max_patterns_per_rank=300).meta["patterns"] == 200


def _cice_named(ds):
    for ours, cice in CICE_NAMES.items():
        if ours in ds:  # the 14 and aice (not the stresses c710abb's reader also reads)
            ds[cice] = ds[ours]
            del ds[ours]


def _zero_ice(ds):
    ds["aice"] = (ds["aice"].dims, np.zeros(ds["aice"].shape, np.float32), ds["aice"].attrs)


def _south_mask_only(ds):
    mask = ds["tmask"].values * (ds["TLAT"].values < 0)
    ds["tmask"] = (ds["tmask"].dims, mask.astype(np.float32), ds["tmask"].attrs)


HOSTILE_NETCDF.update({
    "CICE names without Tair_h": (lambda ds: (_cice_named(ds), ds.__delitem__("Tair_h")), {},
                                  "has no input variable 'tair' (nor 'Tair_h', 'air_temperature'"),
    "an explicit name not in the file": (lambda ds: None, {"variables": {"sst": "SST"}},
                                         "has no input variable 'SST'"),
    "--mask-variable umask, none in the file": (lambda ds: None, {"mask_variable": "umask"},
                                                "has no mask variable 'umask'"),
    "neither tmask nor umask": (lambda ds: ds.__delitem__("tmask"), {}, "has no mask variable 'tmask' (nor 'umask')"),
    "--lat-variable ULAT, none in the file": (lambda ds: None, {"lat_variable": "ULAT"},
                                              "has no latitude variable 'ULAT'"),
    "no latitude for --hemisphere north": (lambda ds: ds.__delitem__("TLAT"), {"min_abs_lat": 0, "hemisphere": "north"},
                                           "has no latitude variable 'TLAT'"),
    "--hemisphere east": (lambda ds: None, {"hemisphere": "east"}, "--hemisphere east is invalid"),
    "no ice anywhere, open water out": (_zero_ice, {"open_water": False}, "no cell has tmask > 0.5 and "
                                        "|TLAT| >= 40.0 and aice > 0"),
    "north asked, the mask only south": (_south_mask_only, {"hemisphere": "north"}, "TLAT >= 40.0"),
    "no ice field, open water out": (lambda ds: ds.__delitem__("aice"), {"outputs": ["hi"], "inputs": ["sst"],
                                                                         "open_water": False},
                                     "has no ice fraction (for open water left out) variable 'aice'"),
})


# ---- dimensions by name, latitudes on the Earth, fields without units, one variable per input ------------------


def _square(ds):
    """The grid cut to 60 x 60 (the first 60 columns): on a square grid a transposed field has the fields' shape."""
    square = ds.isel(ni=slice(0, 60))
    for name in list(ds.data_vars):
        del ds[name]
    for name, variable in square.data_vars.items():
        ds[name] = variable


def _stored_as_ni_nj(ds, names=("hi", "tmask", "TLAT")):
    """The same values, stored with the grid's dimensions the other way round: (time, ni, nj) / (ni, nj)."""
    for name in names:
        ds[name] = ds[name].transpose(..., "ni", "nj")


def _square_with_unrelated_names(ds):
    _square(ds)
    ds["hi"] = (("time", "y", "x"), ds["hi"].values, ds["hi"].attrs)


def _without_units(ds, name):
    del ds[name].attrs["units"]


def _one_standard_name_twice(ds):
    for twin in ("SST_a", "SST_b"):
        ds[twin] = ds["sst"].assign_attrs(standard_name="sea_surface_temperature")
    del ds["sst"]


@pytest.mark.parametrize("square", [False, True], ids=["60x120", "60x60"])
def test_a_field_stored_as_ni_nj_is_read_by_dimension_name(square, grid_file, accelerator, tmp_path):
    """A field, the mask and the latitudes stored (ni, nj) beside fields stored (nj, ni) give the patterns of the file
    stored one way; on a square grid, read by position, they would have the same shape and be silently transposed."""
    cut = _square if square else (lambda ds: None)
    plain = _edited(grid_file, tmp_path / "plain.nc", cut)
    turned = _edited(grid_file, tmp_path / "turned.nc", lambda ds: (cut(ds), _stored_as_ni_nj(ds)))
    with xr.open_dataset(turned) as ds:
        assert ds["hi"].dims == ("time", "ni", "nj") and ds["sst"].dims == ("time", "nj", "ni")
        assert ds["tmask"].dims == ds["TLAT"].dims == ("ni", "nj")
    expected, got = load_patterns(accelerator, plain, seed=1), load_patterns(accelerator, turned, seed=1)
    assert got.meta["patterns"] == expected.meta["patterns"] > 100
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def _stored_as_ni_nj_throughout(ds):
    """Every variable on the grid, fields, mask and latitudes alike, stored (time, ni, nj) / (ni, nj)."""
    _stored_as_ni_nj(ds, [name for name in ds.data_vars if {"nj", "ni"} <= set(ds[name].dims)])


@pytest.mark.parametrize("flags", [{}, {"thin": 3, "max_patterns": 300}, {"hemisphere": "south", "open_water": False}],
                         ids=["default", "thin-and-cap", "south-ice-only"])
def test_a_file_stored_ni_nj_throughout_gives_the_patterns_in_the_order_of_nj_ni(flags, grid_file, accelerator,
                                                                                  tmp_path):
    """The cells are numbered rows then columns ((nj, ni)) whatever the order the file stores them in: the same data
    stored (ni, nj) throughout gives the same patterns in the same order, the same validation split, the same cap
    and the same statistics (read in the stored order, the cells came in another order: another split and another
    training run from the same seed)."""
    turned = _edited(grid_file, tmp_path / "turned.nc", _stored_as_ni_nj_throughout)
    with xr.open_dataset(turned) as ds:
        assert ds["sst"].dims == ("time", "ni", "nj") and ds["aice"].dims == ("time", "ni", "nj")
        assert ds["tmask"].dims == ds["TLAT"].dims == ("ni", "nj")
    expected, got = load_patterns(accelerator, grid_file, seed=1, **flags), load_patterns(accelerator, turned, seed=1,
                                                                                           **flags)
    assert got.meta["grid"] == expected.meta["grid"] == [60, 120]
    assert got.meta["patterns"] == expected.meta["patterns"] > 100
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets", "input_mean", "input_std",
                 "output_mean", "output_std"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_a_field_under_names_that_say_nothing_follows_the_grid_by_its_sizes(grid_file, accelerator, tmp_path):
    """Every field stored (ni, nj) but hi, stored as (time, a, b) in the same layout: the other fields are read
    (nj, ni), and hi, whose names say nothing, is read transposed by its sizes (120 x 60 on a 60 x 120 grid)."""

    def edit(ds):
        _stored_as_ni_nj_throughout(ds)
        ds["hi"] = (("time", "a", "b"), ds["hi"].values, ds["hi"].attrs)

    odd = _edited(grid_file, tmp_path / "odd.nc", edit)
    expected, got = load_patterns(accelerator, grid_file, seed=1), load_patterns(accelerator, odd, seed=1)
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_fields_without_units_in_their_plausible_range_are_accepted(grid_file, accelerator, tmp_path):
    bare = _edited(grid_file, tmp_path / "bare.nc", lambda ds: [_without_units(ds, n) for n in [*FIELDS, "aice"]])
    with xr.open_dataset(bare) as ds:
        assert not any("units" in ds[name].attrs for name in FIELDS)
    plain = load_patterns(accelerator, grid_file)
    assert torch.equal(load_patterns(accelerator, bare).train_inputs, plain.train_inputs)


def test_an_explicit_name_settles_an_ambiguous_input(grid_file, accelerator, tmp_path):
    path = _edited(grid_file, tmp_path / "twins.nc", _one_standard_name_twice)
    chosen = load_patterns(accelerator, path, variables={"sst": "SST_b"})
    assert chosen.meta["variables"]["sst"] == "SST_b"
    assert torch.equal(chosen.train_inputs, load_patterns(accelerator, grid_file).train_inputs)


def _latitudes_nan_at(cells):
    def edit(ds):
        values = ds["TLAT"].values.copy()
        values.reshape(-1)[cells] = np.nan
        ds["TLAT"] = (ds["TLAT"].dims, values, ds["TLAT"].attrs)

    return edit


def test_nan_latitudes_in_ocean_cells_are_one_line_and_on_land_change_nothing(grid_file, accelerator, tmp_path):
    """A NaN latitude fails every latitude bound: in a cell the mask keeps it would drop the cell without a word.
    It is refused in one line with the count, the first cell by dimension name and what is valid; on land (cells the
    mask leaves out) it changes nothing."""
    with xr.open_dataset(grid_file) as ds:
        ocean = ds["tmask"].values.reshape(-1) > 0.5
        shape, dims = ds["TLAT"].shape, ds["TLAT"].dims
    assert dims == ("nj", "ni") and ocean.any() and not ocean.all()
    cells = np.flatnonzero(ocean)[:: ocean.sum() // 20][:20]  # ocean cells poleward of 40 and not, all refused
    holes = _edited(grid_file, tmp_path / "holes.nc", _latitudes_nan_at(cells))
    with pytest.raises(UsageError) as error:
        load_patterns(accelerator, holes)
    j, i = np.unravel_index(cells[0], shape)
    assert str(error.value) == (
        f"--data {holes}: latitude 'TLAT' is NaN/inf at 20 of the cells the mask keeps (e.g. nj={j}, ni={i}: nan); "
        "latitudes there must be finite degrees north, -90 .. 90: fill them, mask those cells, or name the latitude "
        "variable with --lat-variable"
    )
    land = _edited(grid_file, tmp_path / "land.nc", _latitudes_nan_at(np.flatnonzero(~ocean)[:20]))
    plain, read = load_patterns(accelerator, grid_file), load_patterns(accelerator, land)
    assert read.meta["patterns"] == plain.meta["patterns"]
    assert torch.equal(read.train_inputs, plain.train_inputs) and torch.equal(read.valid_targets, plain.valid_targets)


HOSTILE_NETCDF.update({
    "a square grid, a field's dimensions named unlike the others'": (
        _square_with_unrelated_names, {},
        "variable 'hi' has dimensions (y, x), 'sst' has (nj, ni): no name in common, and on a square 60 x 60 grid"),
    "latitude 95 in the domain": (lambda ds: _set_inside(ds, "TLAT", np.float32(95.0), 3), {},
                                  "latitude 'TLAT' has 3 values outside -90 .. 90 (e.g. 95)"),
    "latitude -123 in the domain": (lambda ds: _set_inside(ds, "TLAT", np.float32(-123.0), 1), {"hemisphere": "south"},
                                    "latitude 'TLAT' has 1 values outside -90 .. 90 (e.g. -123)"),
    "NaN latitudes in ocean cells": (lambda ds: _set_inside(ds, "TLAT", np.float32(np.nan), 20), {},
                                     "latitude 'TLAT' is NaN/inf at 20 of the cells the mask keeps (e.g. nj="),
    "an infinite latitude, the south asked": (lambda ds: _set_inside(ds, "TLAT", np.float32(-np.inf), 1),
                                              {"hemisphere": "south"},
                                              "latitude 'TLAT' is NaN/inf at 1 of the cells the mask keeps"),
    "air at 1e4 K, no units attribute": (lambda ds: (_set_inside(ds, "tair", np.float32(1e4), 1),
                                                     _without_units(ds, "tair")), {},
                                         "field 'tair' (no units attribute: the range of tair in any of its usual "
                                         "units) has 1 values outside -120 .. 350"),
    "ice 1 km thick, no units attribute": (lambda ds: (_set_inside(ds, "hi", np.float32(1000.0), 2),
                                                       _without_units(ds, "hi")), {},
                                           "field 'hi' (no units attribute"),
    "two variables with one standard_name": (_one_standard_name_twice, {},
                                             "input 'sst' is ambiguous: both 'SST_a' (standard_name "
                                             "sea_surface_temperature) and 'SST_b' (standard_name "
                                             "sea_surface_temperature) name it; choose one with --variables sst=VAR"),
    "our name and the CICE name for one input": (lambda ds: ds.__setitem__("aice_h", ds["aice"]), {},
                                                 "output 'aice' is ambiguous: both 'aice' (our name) and 'aice_h' "
                                                 "(the CICE history name) name it"),
})


# Parametrized here, after the last HOSTILE_NETCDF.update above: the list is taken when the decorator runs.
@pytest.mark.parametrize("case", list(HOSTILE_NETCDF))
def test_hostile_netcdf_files_are_one_line_naming_file_and_variable(case, grid_file, accelerator, tmp_path):
    edit, flags, fragment = HOSTILE_NETCDF[case]
    path = _edited(grid_file, tmp_path / "hostile.nc", edit)
    with pytest.raises(UsageError) as error:
        load_patterns(accelerator, path, **flags)
    message = str(error.value)
    names_the_file = str(path) in message or fragment.startswith("--")  # a bad flag names the flag instead
    assert "\n" not in message and names_the_file and fragment in message, message


# ---- two files: each named in its errors; a grid mismatch is one line with both shapes ----------------------


def _ocean_and_atmos(where, atmos_grid=(60, 120)):
    ocean = synthesize(where / "ocean.nc", seed=3, nlat=60, nlon=120, naming="cice", atmos_out=where / "atmos.nc")
    if atmos_grid != (60, 120):
        synthesize(where / "other.nc", seed=3, nlat=atmos_grid[0], nlon=atmos_grid[1], naming="cice",
                   atmos_out=where / "atmos.nc")
    return ocean, where / "atmos.nc"


def _atmos_nan(where):
    ocean, atmos = _ocean_and_atmos(where)
    with xr.open_dataset(ocean) as o:
        inside = np.flatnonzero(_domain(o))[:3]

    def poke(ds):
        values = ds["Qref_h"].values.copy()
        values.reshape(-1)[inside] = np.nan
        ds["Qref_h"] = (ds["Qref_h"].dims, values, ds["Qref_h"].attrs)

    _edited(atmos, where / "atmos-nan.nc", poke)
    return ocean, where / "atmos-nan.nc"


def _atmos_text(where):
    ocean, _ = _ocean_and_atmos(where)
    (where / "atmos.txt").write_text("not netCDF")
    return ocean, where / "atmos.txt"


TWO_FILES = {
    "another grid": (lambda w: _ocean_and_atmos(w, (30, 60)),
                     "are on different grids: 'sst_h' is (60, 120) in the first, 'Tair_h' is (30, 60) in the second"),
    "no such atmosphere file": (lambda w: (_ocean_and_atmos(w)[0], w / "nowhere.nc"),
                                "--data-atmos {atmos} does not exist"),
    "atmosphere file not netCDF": (_atmos_text, "--data-atmos {atmos} is not a readable netCDF file"),
    "a field in neither file": (lambda w: _ocean_and_atmos(w), "--data {ocean} and --data-atmos {atmos} have no input "
                                "variable 'salt'"),
    "an atmosphere file nothing is taken from": (lambda w: (synthesize(w / "all.nc", seed=3, nlat=60, nlon=120),
                                                          _ocean_and_atmos(w)[1]),
                                                 "--data-atmos {atmos}: no field was taken from it: --data {ocean} "
                                                 "(searched first) holds all of sst, sss,"),
    "NaN in the atmosphere": (_atmos_nan, "{ocean} (with --data-atmos {atmos}): input field 'qref' has 3 NaN/inf"),
}


@pytest.mark.parametrize("case", list(TWO_FILES))
def test_two_file_errors_are_one_line_naming_both_files(case, accelerator, tmp_path):
    make, fragment = TWO_FILES[case]
    ocean, atmos = make(tmp_path)
    inputs = [*DEFAULT_INPUTS, "salt"] if "neither" in case else DEFAULT_INPUTS
    with pytest.raises(UsageError) as error:
        load_patterns(accelerator, ocean, atmos_path=atmos, inputs=inputs)
    message = str(error.value)
    assert "\n" not in message and fragment.format(ocean=ocean, atmos=atmos) in message, message
    if "grid" in case:
        assert str(ocean) in message and str(atmos) in message


GENERATOR_BAD_FLAGS = {
    "--naming cf": (["--naming", "cf"], "--naming cf is invalid; give ours (sst, aice, ...) or cice"),
    "--atmos-out a directory": (["--atmos-out", "{tmp}"], "--atmos-out {tmp} is a directory"),
    "--atmos-out the --out file": (["--atmos-out", "{tmp}/x.nc"], "--atmos-out {tmp}/x.nc is the --out file"),
}


@pytest.mark.parametrize("case", list(GENERATOR_BAD_FLAGS))
def test_generator_bad_flags_are_one_line_and_write_nothing(case, tmp_path):
    flags, fragment = GENERATOR_BAD_FLAGS[case]
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.data.ufs", "synth", "--out", str(tmp_path / "x.nc"), "--nlat", "4", "--nlon",
         "8", *[f.format(tmp=tmp_path) for f in flags]],
        cwd=ROOT, capture_output=True, text=True,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert fragment.format(tmp=tmp_path) in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []
