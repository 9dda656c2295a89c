"""`python -m toolkit.export aoti`: the AOTInductor package (.pt2) that C++ loads (export/cpp/)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.export.load import load_run, quiet_torch_internals
from toolkit.process.torch_floor import AOTI, require_torch

AOTI_INSTEAD = ("pip install 'torch>=2.6', or export TorchScript for C++ instead (python -m toolkit.export "
                "torchscript RUN_DIR --out emulator.pt)")


def export_aoti(run_dir: Path | str, out: Path | str, step: int | None = None) -> dict:
    """Write the AOTInductor package (.pt2); returns its meta (also in the package's metadata)."""
    from toolkit.models.ufs_emulator import ExportedEmulator

    require_torch(AOTI, "python -m toolkit.export aoti", AOTI_INSTEAD)
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name, e.g. {out}/emulator.pt2")
    if out.suffix != ".pt2":
        raise UsageError(f"--out {out} does not end in .pt2; AOTInductor packages are .pt2 files, e.g. emulator.pt2")
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is a file, not a directory")
    compiler = os.environ.get("CXX", "g++")  # what inductor compiles the package's C++ with
    if shutil.which(compiler) is None:
        raise UsageError(
            f"AOTInductor compiles C++ at export time and the compiler {compiler!r} (CXX, else g++) is not "
            "installed here: apt-get install g++ (make cpp-tools), or set CXX to one"
        )
    model, meta = load_run(run_dir, step)
    exported_module = ExportedEmulator(model)
    # Two example points (torch.export specialises a dimension of size 1); `points` is symbolic: any n >= 1.
    example = model.input_mean.unsqueeze(0).repeat(2, 1)
    with quiet_torch_internals():
        import torch._inductor

        program = torch.export.export(
            exported_module, (example,), dynamic_shapes={"x": {0: torch.export.Dim("points", min=1)}}
        )
        metadata = {
            "inputs": ",".join(meta["inputs"]),
            "outputs": ",".join(meta["outputs"]),
            "meta.json": json.dumps(meta),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.stem}.{os.getpid()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(partial), inductor_configs={"aot_inductor.metadata": metadata}
            )
            partial.replace(out)
        finally:
            partial.unlink(missing_ok=True)
    return meta
