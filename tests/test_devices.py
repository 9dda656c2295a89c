"""The places where the code takes another path on CUDA, made testable here (benchmarks/README.md lists them all):
which device a launch asks for, pinned memory, and the HRM carry moved from a checkpoint onto the run's device."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from toolkit.run.devices import pin_memory, runs_on_cpu


@pytest.mark.parametrize(
    ("env", "cuda", "expected"),
    [
        ({}, False, True),  # no CUDA: the CPU
        ({}, True, False),  # a GPU config on a GPU machine
        ({"ACCELERATE_USE_CPU": "True"}, True, True),  # cpu.yaml / cpu_2proc.yaml on a GPU machine (use_cpu: true)
        ({"ACCELERATE_USE_CPU": "False"}, True, False),  # what accelerate launch sets for 1gpu.yaml
    ],
)
def test_a_cpu_launch_config_runs_on_the_cpu_also_on_a_gpu_machine(env, cuda, expected):
    # PartialState(cpu=False) ignores ACCELERATE_USE_CPU: it would form an NCCL group on the GPU for cpu_2proc.yaml.
    assert runs_on_cpu(env, cuda_available=cuda) is expected


def test_accelerate_launch_passes_use_cpu_to_the_workers(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import os; print('USE_CPU=' + os.environ['ACCELERATE_USE_CPU'])\n")
    for config, expected in (("cpu.yaml", "True"), ("1gpu.yaml", "False")):
        out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                              str(ROOT / "accelerate_configs" / config), str(script)],
                             capture_output=True, text=True, check=True).stdout
        assert f"USE_CPU={expected}" in out


def test_memory_is_pinned_only_for_batches_bound_for_cuda():
    assert pin_memory("cuda:0") and pin_memory(torch.device("cuda"))
    assert not pin_memory("cpu") and not pin_memory("cpu:0")  # a multi-process CPU run's device is cpu:0


def test_the_hrm_carry_loaded_on_the_cpu_moves_to_the_runs_device(monkeypatch):
    """Checkpoints are read with map_location="cpu"; the carry (recurrent state per row) must then go to the device
    the model is on. The meta device stands in for CUDA here: a tensor left behind would stay on the CPU."""
    spec = importlib.util.spec_from_file_location("hrm_recipe", ROOT / "recipes" / "hrm.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hrm_recipe", recipe)  # its dataclasses look their module up there
    spec.loader.exec_module(recipe)
    saved = recipe.Carry()
    saved.state = {"z_h": torch.ones(2, 3), "halted": torch.tensor([True, False]), "steps": torch.tensor([1, 2])}
    carry = recipe.Carry()
    carry.load_state_dict(saved.state_dict())
    moved = carry.on(torch.device("meta"))
    assert {k: v.device.type for k, v in moved.items()} == {"z_h": "meta", "halted": "meta", "steps": "meta"}
    assert {k: v.dtype for k, v in moved.items()} == {k: v.dtype for k, v in saved.state.items()}
    assert recipe.Carry().on(torch.device("meta")) is None  # no carry yet: the recipe starts a fresh one
