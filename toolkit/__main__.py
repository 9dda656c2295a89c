"""`python -m toolkit COMMAND`: tools around the recipes.

python -m toolkit doctor [--timeout S] [--skip-bandwidth] [--sizes-mb 1 64] [--json PATH]
    check that this launch forms a working process group (values of every collective, bandwidth); works under
    plain python, `accelerate launch -m toolkit doctor`, `torchrun -m toolkit doctor` and srun
python -m toolkit verify RUN_DIR [--expect-world-size N] [--expect-backend gloo]
    check a finished run directory: files, steps/epochs, metrics, checkpoints, world size, throughput
"""

from __future__ import annotations

import argparse
import sys

from toolkit import doctor, verify
from toolkit.errors import exit_on_usage_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit",
        description="Tools around the recipes: check a launch's process group, check a finished run directory.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor_parser = commands.add_parser(
        "doctor",
        help="check that this launch forms a working process group (collective values, barrier, bandwidth)",
        description=doctor.__doc__.split("\n\n")[0],
    )
    doctor.add_arguments(doctor_parser)
    doctor_parser.set_defaults(handler=doctor.main)
    verify_parser = commands.add_parser(
        "verify",
        help="check a finished run directory (files, steps, metrics, checkpoints, world size, throughput)",
        description=verify.__doc__.split("\n\n")[0],
    )
    verify.add_arguments(verify_parser)
    verify_parser.set_defaults(handler=verify.main)
    return parser


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
