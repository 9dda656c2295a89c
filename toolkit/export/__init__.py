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

The package's parts: load (the checkpoint, the registry EXPORTABLE of families that export knows, packages), aoti
(the .pt2), netcdf (read the domain, predict in chunks, write the file). Supported recipes: ufs_emulator. Bad input
(a path, a run, a package, a missing variable, units that differ from the training's, NaN inside the domain) is one
line, exit 2, before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from toolkit.entry import one_line_errors
from toolkit.errors import UsageError
from toolkit.export.aoti import export_aoti
from toolkit.export.load import EXPORTABLE, Exportable, best_checkpoint, load_package, load_run
from toolkit.export.netcdf import predict_netcdf

__all__ = ["EXPORTABLE", "Exportable", "best_checkpoint", "export_aoti", "load_package", "load_run", "main",
           "predict_netcdf"]


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
