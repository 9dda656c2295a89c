"""`python -m toolkit COMMAND`: tools around the recipes.

python -m toolkit doctor [--timeout S] [--skip-bandwidth] [--sizes-mb 1 64] [--json PATH]
    check that this launch forms a working process group (values of every collective, bandwidth); works under
    plain python, `accelerate launch -m toolkit doctor`, `torchrun -m toolkit doctor` and srun
python -m toolkit verify RUN_DIR [--expect-world-size N] [--expect-backend gloo]
    check a finished run directory: files, steps/epochs, metrics, checkpoints, world size, throughput
python -m toolkit compare DIR... [--metric NAME] [--out PNG] [--csv FILE] [--markdown FILE]
    one table of groups of runs that differ only by seed (mean ± std, n) and one picture of their curves
python -m toolkit sweep RECIPE --grid KEY=V1,V2 ... --out DIR [--launcher local|slurm] [-- FLAGS FOR EVERY RUN]
    one run per combination of the grid's values, here or as one SLURM job array; again: skips finished runs
python -m toolkit sweep RECIPE --search SPEC... --trials N --metric NAME --out DIR [-- FLAGS FOR EVERY TRIAL]
    an Optuna study, one run per trial (pruning, resume, parallel trials, SLURM job arrays)
python -m toolkit ls [DIR]
    the recipes and their presets, each with its one-line description
python -m toolkit launch [accelerate launch arguments]
    accelerate launch with a rendezvous timeout and one-line errors for launch failures
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from toolkit.process import begin_process

begin_process()  # an entry point, as a recipe is: before torch (SIGTERM said in one line, OpenMP's policy, ...)

if sys.argv[1:2] == ["launch"] and "TORCH_CPP_LOG_LEVEL" not in os.environ:
    # The launcher's own c10d retry logs (C++ stack frames) would bury its one-line error; read when torch loads,
    # so it is set before the imports below and removed again in launch.main for the workers.
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    os.environ["_TOOLKIT_QUIET_LAUNCHER"] = "1"

from toolkit.process.entry import one_line_errors  # noqa: E402
from toolkit.tools import catalog, compare, doctor, launch, search, sweep, verify  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit",
        description="Tools around the recipes: check a launch's process group, check a finished run directory.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subcommands = [
        (doctor, "check that this launch forms a working process group (collective values, barrier, bandwidth)"),
        (verify, "check a finished run directory (files, steps, metrics, checkpoints, world size, throughput)"),
        (compare, "compare runs: mean ± std per group of seeds, one table and one picture of the curves"),
        (sweep, "run a grid or an Optuna search of flag values over a recipe, here or as a SLURM job array"),
    ]
    listing = commands.add_parser("ls", help="list the recipes and their presets",
                                  description=catalog.__doc__.split("\n\n")[0])
    catalog.add_arguments(listing)
    listing.set_defaults(handler=catalog.main)
    for module, summary in subcommands:
        name = module.__name__.rsplit(".", 1)[-1]
        sub = commands.add_parser(name, help=summary, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(sub)
        sub.set_defaults(handler=module.main)
        if module is sweep:  # a sweep is a grid or a search: search.main takes both
            search.add_arguments(sub)
            sub.set_defaults(handler=search.main)
    launch_parser = commands.add_parser(
        "launch", help="accelerate launch with a rendezvous timeout and one-line launch errors", add_help=False
    )
    launch_parser.add_argument("arguments", nargs=argparse.REMAINDER, help="exactly what accelerate launch takes")
    launch_parser.set_defaults(handler=lambda args: launch.main(args.arguments))
    return parser


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # everything after it belongs to accelerate launch, options included
        return launch.main(argv[1:])
    if argv[:2] == ["sweep", "--trial-worker"] and len(argv) == 3:  # a SLURM array task of a search takes a trial
        return search.claim(Path(argv[2]))
    common: list[str] = []
    if argv[:1] == ["sweep"]:  # the flags after `--` go to every run of the sweep, not to argparse
        argv, common = sweep.split_common(argv)
    args = build_parser().parse_args(argv)
    args.common = common
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
