"""Export a trained run for use outside Python.

    python -m toolkit.export torchscript RUN_DIR --out emulator.pt [--step N]

Loads the run's config.json and the weights of its best-validation checkpoint (summary.json's best_step; for a
run that has not finished, the best step recorded in its newest complete checkpoint; --step N picks another
complete checkpoint), rebuilds the model and writes a TorchScript module whose forward() takes PHYSICAL inputs
[n, inputs] and returns physical outputs [n, outputs] (float64): the normalisation statistics are buffers of the
model. The input and output names travel as module attributes and in the file's extra file `meta.json`. C++
programs load it with torch::jit::load (export/cpp/).

Supported recipes: ufs_emulator.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from toolkit import checkpoint
from toolkit.errors import UsageError, exit_on_usage_error


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(
            f"{path} is missing or unreadable ({what}; {type(error).__name__}); give a run directory "
            "written by a recipe (runs/<recipe>/<run>)"
        ) from None


def best_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint to export: --step, else the best-validation step (summary.json, else the newest complete
    checkpoint's progress); refused when incomplete or damaged."""
    if step is None:
        summary_path = run_dir / "summary.json"
        if summary_path.is_file():
            step = _read_json(summary_path, "the run's summary").get("best_step")
        else:
            newest = checkpoint.newest_complete(run_dir)
            if newest is None:
                raise UsageError(f"{run_dir} has no complete checkpoint to export; train first (or give a run dir)")
            step = checkpoint.read_progress(newest).get("best_step") or checkpoint.step_of(newest)
    if step is None:
        raise UsageError(f"{run_dir}/summary.json names no best step; give --step N")
    found = checkpoint.checkpoints_root(run_dir) / f"step_{int(step)}"
    if not checkpoint.is_complete(found):
        raise UsageError(f"{found} is not a complete checkpoint; give --step N of one under {found.parent}")
    damage = checkpoint.damage_of(found)
    if damage:
        raise UsageError(f"{found} is damaged ({damage}); give --step N of an intact checkpoint")
    return found


def _ufs_emulator(config: dict, weights: dict) -> torch.nn.Module:
    from toolkit.models.ufs_emulator import PhysicalEmulator, from_run_config

    model = from_run_config(config)
    model.load_state_dict(weights)
    return PhysicalEmulator(model.eval(), list(config["inputs"]), list(config["outputs"]))


EXPORTABLE = {"ufs_emulator": _ufs_emulator}


def export_torchscript(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write the TorchScript module; returns what was exported (recipe, checkpoint, input and output names)."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a directory; give a run directory (runs/<recipe>/<run>)")
    info = _read_json(run_dir / "config.json", "the run's settings")
    recipe = info.get("recipe")
    if recipe not in EXPORTABLE:
        raise UsageError(f"{run_dir} is a run of {recipe!r}; torchscript export supports {', '.join(EXPORTABLE)}")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulator.pt")
    found = best_checkpoint(run_dir, step)
    weights = load_file(str(found / "model.safetensors"))
    config = info["config"]
    module = torch.jit.script(EXPORTABLE[recipe](config, weights))
    meta = {
        "recipe": recipe,
        "run_dir": str(run_dir),
        "checkpoint": found.name,
        "inputs": list(config["inputs"]),
        "outputs": list(config["outputs"]),
        "units": info.get("data", {}).get("units"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        torch.jit.save(module, str(partial), _extra_files={"meta.json": json.dumps(meta)})
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return meta


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m toolkit.export", description=__doc__.split("\n\n")[0])
    formats = parser.add_subparsers(dest="format", required=True)
    script = formats.add_parser("torchscript", help="a TorchScript module predicting in physical units")
    script.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    script.add_argument("--out", type=Path, required=True, help="file to write, e.g. emulator.pt")
    script.add_argument("--step", type=int, default=None, help="export this checkpoint instead of the best")
    args = parser.parse_args(argv)
    meta = export_torchscript(args.run_dir, args.out, args.step)
    print(
        f"wrote {args.out}: {meta['recipe']} from {meta['checkpoint']}, inputs {' '.join(meta['inputs'])} -> "
        f"outputs {' '.join(meta['outputs'])} (physical units, float64)"
    )


if __name__ == "__main__":
    main()
