"""The SASRec recipe end to end through real launchers, on the real MovieLens-100K, tiny model."""

import csv

import pytest
from conftest import TINY, final_weights, ranks_seen, read_json, run_recipe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", ["sasrec", "tisasrec", "sasrec-mhc", "tisasrec-mhc"])
def test_every_variant_trains_and_evaluates_through_accelerate_launch(variant, tmp_path, movielens_cache):
    out = tmp_path / "run"
    norm = {"sasrec": "post", "tisasrec": "pre", "sasrec-mhc": "original", "tisasrec-mhc": "post"}[variant]
    run_recipe([*TINY, "--variant", variant, "--norm", norm, "--max-steps", "3", "--output-dir", str(out)],
               config="cpu.yaml")
    summary = read_json(out / "summary.json")
    assert summary["global_step"] == 3 and summary["world_size"] == 1
    test = summary["test_metrics_at_best"]
    for key in ["test_sampled_hr@10", "test_sampled_ndcg@10", "test_full_hr@10", "test_full_ndcg@10"]:
        assert 0.0 <= test[key] <= 1.0
    assert test["test_users"] == 943  # every user evaluated exactly once
    config = read_json(out / "config.json")
    assert config["config"]["variant"] == variant and config["mixed_precision"] == "no"
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert rows[-1]["step"] == "3" and float(rows[-1]["train_loss"]) > 0
    for column in ["val_sampled_ndcg@10", "val_full_ndcg@10", "throughput_samples_per_sec", "data_load_time_sec",
                   "cpu_util_avg", "gpu_util_avg", "world_size"]:
        assert column in rows[-1]
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "step_3" / "COMPLETE").exists()


def test_two_cpu_processes_form_one_gloo_group(tmp_path, movielens_cache):
    out = tmp_path / "run"
    result = run_recipe([*TINY, "--max-steps", "4", "--dropout", "0", "--output-dir", str(out)],
                        config="cpu_2proc.yaml")
    assert ranks_seen(result.stderr) == {(0, 2), (1, 2)}  # the world size seen from inside both processes
    assert "backend=gloo" in result.stderr
    config = read_json(out / "config.json")
    assert config["world_size"] == 2 and config["backend"] == "gloo"
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2
    # gather_for_metrics: 943 users split over 2 ranks with padding on the last batch, each counted once
    assert summary["test_metrics_at_best"]["test_users"] == 943
    assert (out / "checkpoints" / "step_4" / "random_states_1.pkl").exists()  # rank 1 saved its RNG state


def test_bf16_on_cpu_trains_in_bf16(tmp_path, movielens_cache):
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    run_recipe([*TINY, "--max-steps", "3", "--mixed-precision", "bf16", "--output-dir", str(bf16)])
    run_recipe([*TINY, "--max-steps", "3", "--mixed-precision", "no", "--output-dir", str(fp32)])
    assert read_json(bf16 / "config.json")["mixed_precision"] == "bf16"
    losses = [float(list(csv.DictReader(open(d / "metrics.csv")))[-1]["train_loss"]) for d in (bf16, fp32)]
    assert 0 < losses[0] < 10
    assert losses[0] != losses[1]  # autocast really ran: same seed and data, different arithmetic
    assert abs(losses[0] - losses[1]) < 0.05 * losses[1]  # ... and still trains the same model
    weights = final_weights(bf16, 3)
    assert all(t.isfinite().all() for t in weights.values())
