"""The C++ consumer's tests skip where LibTorch cannot be configured on this machine and fail on our own errors:
tests/cmake_configure.py's decision, on cmake's real output (captured on this project's machines)."""

from __future__ import annotations

import shutil

import pytest
import torch
from cmake_configure import environment_problem
from conftest import ROOT
from test_ufs_export import build_cpp_consumer

SOURCES = ROOT / "export" / "cpp"
SITE = "/work/main/.cache/smoke/venv-torch-2.4.1/lib/python3.11/site-packages"

# torch 2.4.1's CUDA wheel (PyPI), no CUDA toolkit: cmake -S export/cpp -B ... -DCMAKE_PREFIX_PATH=<its cmake path>
CUDA_BUILD_2_4 = f"""-- The CXX compiler identification is GNU 12.2.0
-- Detecting CXX compile features - done
-- Could NOT find CUDA (missing: CUDA_INCLUDE_DIRS CUDA_CUDART_LIBRARY) (found version "13.0")
CMake Warning at {SITE}/torch/share/cmake/Caffe2/public/cuda.cmake:31 (message):
  Caffe2: CUDA cannot be found.  Depending on whether you are building Caffe2
  or a Caffe2 dependent library, the next warning / error will give you more
  info.
Call Stack (most recent call first):
  {SITE}/torch/share/cmake/Caffe2/Caffe2Config.cmake:86 (include)
  {SITE}/torch/share/cmake/Torch/TorchConfig.cmake:68 (find_package)
  CMakeLists.txt:13 (find_package)


CMake Error at {SITE}/torch/share/cmake/Caffe2/Caffe2Config.cmake:90 (message):
  Your installed Caffe2 version uses CUDA but I cannot find the CUDA
  libraries.  Please set the proper CUDA prefixes and / or install CUDA.
Call Stack (most recent call first):
  {SITE}/torch/share/cmake/Torch/TorchConfig.cmake:68 (find_package)
  CMakeLists.txt:13 (find_package)


-- Configuring incomplete, errors occurred!
See also "/tmp/cuda241-build/CMakeFiles/CMakeOutput.log".
"""

# torch 2.15.0's CUDA wheel (PyPI), no CUDA toolkit: the same stop, reached through find_dependency
SITE_2_15 = "/work/main/.cache/smoke/venv-torch-2.15.0/lib/python3.11/site-packages"
CUDA_BUILD_2_15 = f"""-- Detecting CXX compile features - done
-- Could NOT find CUDA (missing: CUDA_INCLUDE_DIRS CUDA_CUDART_LIBRARY) (found version "13.0")
CMake Warning at {SITE_2_15}/torch/share/cmake/Caffe2/public/cuda.cmake:40 (message):
  PyTorch: CUDA cannot be found.  Depending on whether you are building
  PyTorch or a PyTorch dependent library, the next warning / error will give
  you more info.
Call Stack (most recent call first):
  {SITE_2_15}/torch/share/cmake/Caffe2/Caffe2Config.cmake:84 (include)
  /usr/share/cmake-3.25/Modules/CMakeFindDependencyMacro.cmake:47 (find_package)
  {SITE_2_15}/torch/share/cmake/Torch/TorchConfig.cmake:62 (find_dependency)
  CMakeLists.txt:13 (find_package)


CMake Error at {SITE_2_15}/torch/share/cmake/Caffe2/Caffe2Config.cmake:88 (message):
  Your installed Caffe2 version uses CUDA but I cannot find the CUDA
  libraries.  Please set the proper CUDA prefixes and / or install CUDA.
Call Stack (most recent call first):
  /usr/share/cmake-3.25/Modules/CMakeFindDependencyMacro.cmake:47 (find_package)
  {SITE_2_15}/torch/share/cmake/Torch/TorchConfig.cmake:62 (find_dependency)
  CMakeLists.txt:13 (find_package)


-- Configuring incomplete, errors occurred!
"""

# Our CMakeLists.txt with a typo (target_link_librarie), torch 2.13's CPU wheel
OURS = """-- The CXX compiler identification is GNU 12.2.0
CMake Warning at /work/main/.venv/lib/python3.11/site-packages/torch/share/cmake/Torch/TorchConfig.cmake:22 (message):
  library kineto not found.
Call Stack (most recent call first):
  /work/main/.venv/lib/python3.11/site-packages/torch/share/cmake/Torch/TorchConfig.cmake:119 (append_torchlib_if_found)
  CMakeLists.txt:13 (find_package)


-- Found Torch: /work/main/.venv/lib/python3.11/site-packages/torch/lib/libtorch.so
CMake Error at CMakeLists.txt:16 (target_link_librarie):
  Unknown CMake command "target_link_librarie".


-- Configuring incomplete, errors occurred!
"""

# `cmake --build` of ufs_emulator.cpp with an undeclared name in main(): a build failure, never a skip
COMPILE_ERROR = """[ 50%] Building CXX object CMakeFiles/ufs_emulator.dir/ufs_emulator.cpp.o
/work/main/export/cpp/ufs_emulator.cpp: In function 'int main(int, char**)':
/work/main/export/cpp/ufs_emulator.cpp:177:5: error: 'undeclared_name_here' was not declared in this scope
  177 |     undeclared_name_here = 1;
      |     ^~~~~~~~~~~~~~~~~~~~
gmake[2]: *** [CMakeFiles/ufs_emulator.dir/build.make:76: CMakeFiles/ufs_emulator.dir/ufs_emulator.cpp.o] Error 1
gmake: *** [Makefile:91: all] Error 2
"""


@pytest.mark.parametrize(("output", "line"), [(CUDA_BUILD_2_4, 90), (CUDA_BUILD_2_15, 88)], ids=["2.4.1", "2.15.0"])
def test_a_cuda_build_without_the_cuda_toolkit_skips_with_cmakes_reason(output, line):
    assert environment_problem(output, SOURCES) == (
        "Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries. Please set the proper CUDA "
        "prefixes and / or install CUDA.; Could NOT find CUDA (missing: CUDA_INCLUDE_DIRS CUDA_CUDART_LIBRARY) (found "
        f'version "13.0") (Caffe2Config.cmake:{line})'
    )


def test_an_error_in_our_cmakelists_or_our_cpp_is_not_skipped():
    assert environment_problem(OURS, SOURCES) is None
    assert environment_problem(OURS.replace("CMakeLists.txt:16", f"{SOURCES}/CMakeLists.txt:16"), SOURCES) is None
    assert environment_problem(COMPILE_ERROR, SOURCES) is None
    assert environment_problem("", SOURCES) is None  # nothing to judge by: a failure


def test_the_consumer_build_skips_where_libtorch_cannot_be_configured(tmp_path, monkeypatch):
    """build_cpp_consumer against a LibTorch whose CMake config stops as a CUDA wheel's does without the toolkit:
    the test skips with cmake's reason instead of failing."""
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.skip("cmake or g++ not installed (make cpp-tools)")
    config = tmp_path / "cmake" / "Torch"
    config.mkdir(parents=True)
    (config / "TorchConfig.cmake").write_text(
        'message(FATAL_ERROR "Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries.")\n'
    )
    monkeypatch.setattr(torch.utils, "cmake_prefix_path", str(tmp_path / "cmake"))
    with pytest.raises(
        pytest.skip.Exception,
        match=r"^LibTorch cannot be configured here: Your installed Caffe2 "
        r"version uses CUDA but I cannot find the CUDA libraries\. \(TorchConfig\.cmake:1\)$",
    ):
        build_cpp_consumer()
