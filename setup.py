"""pyproject.toml holds the project; this adds one file to what is installed: accelerate_recipes_launcher.pth, beside
the packages in site-packages, so that `accelerate launch` and `torchrun` stopped by a signal end in one line
instead of torch's traceback (toolkit/process/launcher_exit.py says why, and that it touches nothing elsewhere).
A wheel carries it as a file of build_py's; an editable install (`pip install -e .`, `make install`) as a file of
the editable wheel's."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).resolve().parent / "accelerate_recipes_launcher.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / PTH.name)]
        return [*super().get_outputs(include_bytecode), *extra]


class EditableWheelWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        # unpacked_wheel: what the editable wheel holds beside its finder, installed into site-packages as it is
        shutil.copyfile(PTH, Path(unpacked_wheel) / PTH.name)
        return super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
