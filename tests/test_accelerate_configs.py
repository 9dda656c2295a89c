"""Every shipped launch config loads with Accelerate's own loader and says how to use it."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "accelerate_configs").glob("*.yaml"))


def test_the_expected_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"cpu", "cpu_2proc", "cpu_4proc", "1gpu", "4gpu", "8gpu", "2node_4gpu", "2node_cpu",
            "cpu_2proc_bf16"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_opens_with_its_launch_command(path):
    config = load_config_from_file(str(path))  # raises on keys Accelerate does not know
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ")
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert f"accelerate launch --config_file accelerate_configs/{path.name}" in header
    if path.stem.startswith("cpu") or "_cpu" in path.stem:
        assert config.use_cpu  # a CPU config must make Accelerate start real gloo ranks
        if config.num_processes > 1:  # MULTI_CPU without a hostfile would silently start ONE process
            assert config.distributed_type.value == "MULTI_GPU"


def test_the_loader_really_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIGS[0].read_text() + "ipex_config: {}\n")
    with pytest.raises((ValueError, TypeError)):
        load_config_from_file(str(bad))
