"""Export a trained run for use outside Python, and run it on a netCDF file.

    python -m toolkit.export aoti RUN_DIR --out emulator.pt2 [--step N]
    python -m toolkit.export torchscript RUN_DIR --out emulator.pt [--format aibalance|aibalance-c710abb|soca|ufsnet]
    python -m toolkit.export predict RUN_DIR --data IN.nc --out OUT.nc [--step N] [--data-atmos ATMOS.nc]
    python -m toolkit.export predict RUN_DIR --data IN.nc --out OUT.nc --lat-variable nav_lat --lon-variable nav_lon
    python -m toolkit.export predict --model emulator.pt2 --data IN.nc --out OUT.nc
    python -m toolkit.export predict RUN_DIR --data IN.nc --out soca.nc --layout soca --plot maps/ [--whole-grid]

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

`torchscript` writes a TorchScript archive for the programs that load TorchScript (torch 2.13 deprecates it: `aoti`
is the artefact for new deployments; torch's deprecation warnings for this export are silenced inside it only).
`--format aibalance` (the default) is aibalance's layout at its HEAD (guillaumevernieres/aibalance b1eccbc,
export_to_torchscript.py): methods forward (normalised in and out), predict (physical -> physical), jac (d y_norm /
d x_norm) and jac_physical, every output float32 as its float32 module returns them, and its metadata attributes
(input_names, output_names, input_levels and output_levels as its exporter sets them: the atmosphere's fields at
nlevs - 1, 127 by default, the ocean's at 0; meta with optimizer and loss as it writes them) plus meta.json as an
extra file (toolkit.export.torchscript). `--format aibalance-c710abb` is the layout of its commit c710abb, whose
forward takes physical inputs (and returns physical outputs, float32; jac is d forward / d x). `--format soca` is
SOCA MLBalance's layout, IceNet's two files (toolkit.export.soca), for a run trained as IceNet (--preset soca);
`--format ufsnet` our MLP in those two files, for export/cpp/ufs_net.h. An existing --out file is replaced whole, as
by `aoti`.

`predict` runs the model (a run's, or --model an exported package) on every cell of IN.nc's sea-ice domain (with
--data-atmos, of the ocean/ice + atmosphere pair on one grid), the files read as the training reads them
(toolkit.data.ufs.open_fields: CICE files, aibalance's CF pair on a Gaussian grid at its surface level, the inputs
the run's domain gives as 0 given as 0) and selected as the run selected them: toolkit.data.ufs.select_patterns
with every domain option of the run's config (mask and latitude variables as the training resolved them, latitude
bound, hemisphere, --no-open-water, and any option select_patterns takes under a config field's name; no thinning,
no cap), said in one printed line; --whole-grid takes every ocean cell instead (the run's mask, or its thickness-tair
ocean). Each input is read under the name the training's file had for it, else ours, CICE's or CF's. --lat-variable
names the latitude in IN.nc as --lon-variable names the longitude (default: the training's latitude; for a run that
read none, the file's own: TLAT, ULAT, lat, latitude or standard_name latitude; the longitude beside it): the
domain's latitude bound reads it, and the output's coordinates are these two. It writes OUT.nc on IN.nc's grid: each
output (e.g. `aice`, standard_name sea_ice_area_fraction, clipped to [0, 1] with the share of cells clipped printed
and in the attribute aice_clipped_share), its Jacobian as one variable per input named d<output>_d<input> (e.g.
`daice_dsst`, units aice's per sst's), longitude and latitude (1-D axes where the input's were), and `domain_mask`;
the input's leading time dimension where it has one; fill values (1e30, as CICE writes) outside the domain; CF
attributes (long_name, units, _FillValue, coordinates). --layout soca writes SOCA's per-point file instead, as
IceEmul.h's predict writes it: dimensions n and n_inputs, every variable float32 on n: lon, lat, the input's aice,
the emulated aice_ffnn, the Jacobian as dcdt, dcds, dcdsi, dcdtair, dcdtsfc, dcdhi, dcdhs, ... (netcdf.soca_name).
--plot DIR draws polar-stereographic maps, north and south, of the emulated output, its error against the input's
and each Jacobian column (toolkit.export.maps). Files are written whole or not at all (temporary file, rename).

The package's parts: load (the checkpoint, the registry EXPORTABLE of families that export knows, packages), aoti
(the .pt2), torchscript and soca (the TorchScript archives), netcdf (read the domain, predict in chunks, write the
file), maps (the PNGs). Supported recipes: ufs_emulator. Bad input (a path, a run, a package, a missing variable,
units that differ from the training's, NaN inside the domain, a --plot that is not a directory) is one line, exit 2,
before anything is written.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.export.aoti import export_aoti
from toolkit.export.load import EXPORTABLE, Exportable, best_checkpoint, load_package, load_run
from toolkit.export.netcdf import predict_netcdf
from toolkit.export.soca import export_soca, export_ufsnet, read_soca, soca_emulator
from toolkit.export.torchscript import export_torchscript, load_torchscript
from toolkit.process.entry import one_line_errors

__all__ = ["EXPORTABLE", "Exportable", "best_checkpoint", "export_aoti", "export_soca", "export_torchscript",
           "load_package", "load_run", "load_torchscript", "main", "predict_netcdf", "read_soca", "soca_emulator"]

TORCHSCRIPT_LAYOUTS = ("aibalance", "aibalance-c710abb", "soca", "ufsnet")


def _torchscript(args) -> None:
    if args.layout not in TORCHSCRIPT_LAYOUTS:
        raise UsageError(f"--format {args.layout!r}: give {', '.join(TORCHSCRIPT_LAYOUTS[:-1])} or "
                         f"{TORCHSCRIPT_LAYOUTS[-1]} (aibalance's ufs_emulator.cpp at HEAD or at c710abb, SOCA's "
                         "MLBalance, or our MLP for export/cpp/ufs_net.h)")
    if args.layout == "soca":
        meta = export_soca(args.run_dir, args.out, args.step)
        norm = Path(args.out).parent / meta["normalization"]
        written = f"{args.out} and {norm} (SOCA's layout: torch::load, loadNorm)"
    elif args.layout == "ufsnet":
        meta = export_ufsnet(args.run_dir, args.out, args.step)
        norm = Path(args.out).parent / meta["normalization"]
        written = f"{args.out} and {norm} (our MLP in SOCA's two-file form, for export/cpp/ufs_net.h)"
    elif args.layout == "aibalance-c710abb":
        meta = export_torchscript(args.run_dir, args.out, args.step, layout=args.layout)
        written = f"{args.out} (TorchScript, aibalance c710abb's layout: forward and jac physical)"
    else:
        meta = export_torchscript(args.run_dir, args.out, args.step)
        written = f"{args.out} (TorchScript, aibalance's layout: predict, jac, jac_physical)"
    dtype = "" if args.layout in ("soca", "ufsnet") else ", float32 out"
    print(
        f"wrote {written}: {meta['recipe']} from {meta['checkpoint']}, inputs {' '.join(meta['inputs'])} -> outputs "
        f"{' '.join(meta['outputs'])}, physical units{dtype}"
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
        "--lat-variable", default=None, help="latitude variable in --data (default: the training's, else the file's "
        "own: TLAT, ULAT, lat, latitude or standard_name latitude); the domain's bound and the output's coordinates"
    )
    predict.add_argument(
        "--lon-variable", default=None, help="longitude variable (default: the latitude's partner, LAT -> LON)"
    )
    predict.add_argument("--data-atmos", type=Path, default=None,
                         help="the atmosphere's file on --data's grid, for a run trained on two files")
    predict.add_argument("--whole-grid", action="store_true",
                         help="every ocean cell (the mask only), not the run's domain (latitude, hemisphere, ...)")
    predict.add_argument("--layout", default="grid",
                         help="grid: the CF file on --data's grid; soca: SOCA's per-point file (aice_ffnn, dcdt, ...)")
    predict.add_argument("--plot", type=Path, default=None, metavar="DIR",
                         help="draw polar-stereographic maps (north, south) of the output, its error, the Jacobian")
    script = formats.add_parser(
        "torchscript", help="TorchScript for aibalance's and SOCA's C++ programs (torch deprecates it: aoti for new)"
    )
    script.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a trained run (runs/<recipe>/<run>)")
    script.add_argument("--out", type=Path, required=True, help="file to write, e.g. emulator.pt")
    script.add_argument("--step", type=int, default=None, help="export this checkpoint instead of the best")
    script.add_argument(
        "--format", dest="layout", default="aibalance", metavar="LAYOUT",
        help="aibalance (default: aibalance HEAD's predict, jac, jac_physical and metadata), aibalance-c710abb (its "
        "c710abb's: forward takes physical inputs), soca (SOCA's IceNet: MODEL.pt + normalization.MODEL.pt) or ufsnet "
        "(our MLP in those two files, for export/cpp/ufs_net.h)",
    )
    args = parser.parse_args(argv)
    check_writable(args.out, "--out")  # before any work: a read-only place failed only at the end, in a traceback
    if args.format == "torchscript":
        _torchscript(args)
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
            lat_variable=args.lat_variable,
            lon_variable=args.lon_variable,
            data_atmos=args.data_atmos,
            whole_grid=args.whole_grid,
            layout=args.layout,
            plot_dir=args.plot,
        )
        print(predict_lines(summary))


def check_writable(out: Path, flag: str) -> None:
    """`out` can be made: its nearest existing directory (missing ones are made) is writable, not on a read-only file
    system or without permission. One line naming the flag and the place otherwise."""
    place = Path(out).absolute().parent
    while not place.exists() and place != place.parent:
        place = place.parent
    if place.is_dir() and not os.access(place, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out}: {place} is not writable (a read-only file system or no permission); give a "
                         "path you can write to")


def predict_lines(summary: dict) -> str:
    """What predict says: the domain it used (one line), what it wrote with the share of cells clipped, the maps."""
    cells = summary["cells"]
    if summary["whole_grid"]:
        domain = f"domain: every ocean cell ({summary['domain']}; --whole-grid), {cells} cells"
    else:
        domain = (f"domain: as the run selected it ({summary['domain']}), {cells} cells; --whole-grid for every "
                  "ocean cell")
    clipped = "".join(f"; {name} clipped to [0, 1] at {count} of {cells} cells ({100 * count / max(cells, 1):.2f}%)"
                      for name, count in summary["clipped"].items())
    what = (f"aice_ffnn and dc/d<input> at {cells} points (SOCA's layout)" if summary["layout"] == "soca" else
            f"{' '.join(summary['outputs'])} and d/d({' '.join(summary['inputs'])}) on {cells} domain cells of a "
            f"{summary['grid'][0]} x {summary['grid'][1]} grid")
    lines = [domain, f"wrote {summary['out']}: {what}, from {summary['source']}{clipped}"]
    if summary["plots"]:
        lines.append(f"wrote {len(summary['plots'])} maps to {Path(summary['plots'][0]).parent}: "
                     f"{', '.join(Path(p).name for p in summary['plots'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
