"""Normalisation statistics over every rank's shard: merge_moments (count, mean, M2 merged by Chan's formula) equals
the single-process float64 two-pass statistics, also where sqrt(E[x^2] - mean^2) fails, and in a real 2-process
gloo run with uneven (and empty) shards."""

from __future__ import annotations

import json
import textwrap
from fractions import Fraction

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from conftest import run_recipe

from toolkit.run.distributed import combine_moments, local_moments, mean_over_processes, merge_moments, std_from_moments
from toolkit.run.metrics import error_metrics, masked_error_sums


def two_pass(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 mean and population std per column, two-pass. Each column is reduced as a contiguous row (numpy's
    pairwise summation); reducing along axis 0 of a C-ordered array sums sequentially, off by ~1e-12 at 1e5 rows."""
    columns = np.ascontiguousarray(x.astype(np.float64).T)
    mean = columns.sum(axis=1) / columns.shape[1]
    deviation = columns - mean[:, None]
    return mean, np.sqrt((deviation * deviation).sum(axis=1) / columns.shape[1])


def fields(rows: int, seed: int = 0) -> np.ndarray:
    """float32 columns like the UFS emulator's: a temperature in K (tiny spread), a salinity, a wind speed, and a
    constant field (std 0 -> 1)."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            273.15 + 1e-4 * rng.standard_normal(rows),
            35.0 + 0.5 * rng.standard_normal(rows),
            1e3 * rng.standard_normal(rows),
            np.full(rows, 5.0),
        ],
        axis=1,
    ).astype(np.float32)


def relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def test_one_process_equals_numpy_two_pass(accelerator):
    assert accelerator.num_processes == 1
    x = fields(20_001)
    count, mean, m2 = merge_moments(accelerator, torch.from_numpy(x))
    assert count.dtype == mean.dtype == m2.dtype == torch.float64 and mean.shape == (4,)
    assert count.tolist() == [20_001.0] * 4
    ref_mean, ref_std = two_pass(x)
    std = std_from_moments(count, m2)
    assert relative(mean, ref_mean) < 1e-12
    assert relative(std[:3], ref_std[:3]) < 1e-12
    assert ref_std[3] == 0 and std[3].item() == 1.0  # a constant field normalises by 1, not by ~0


def test_mean_over_one_process_is_the_value_itself(accelerator):
    value = torch.tensor(0.25)
    assert mean_over_processes(accelerator, value) is value  # no copy, no division: every step of a 1 ms model


def test_accurate_where_the_naive_formula_is_not():
    # Temperatures ~273.15 K with spread 1e-4, stored as float32: E[x^2] ~ 7.5e4 and the variance ~ 1e-8.
    x = fields(20_000, seed=3)[:, :1]
    exact_mean = sum(map(Fraction, x[:, 0].astype(np.float64).tolist()), Fraction(0)) / len(x)
    exact_m2 = sum((Fraction(v) - exact_mean) ** 2 for v in x[:, 0].astype(np.float64).tolist())
    exact_std = float(np.sqrt(float(exact_m2 / len(x))))
    count, mean, _, m2 = local_moments(torch.from_numpy(x))
    assert abs(mean.item() - float(exact_mean)) <= 1e-15 * float(exact_mean)
    assert relative(m2, float(exact_m2)) < 1e-12
    # Shards merged by Chan's formula: still exact to rounding. (With plain float64 means in the merge, delta =
    # mean_b - mean_a carries their rounding, ~3e-14 K against a spread of 1e-4 K: M2 off by ~1e-12.)
    for cut in [7, 10_000, 19_990]:
        parts = torch.stack([local_moments(torch.from_numpy(x[:cut])), local_moments(torch.from_numpy(x[cut:]))])
        merged = combine_moments(parts)
        assert relative(merged[1], float(exact_mean)) < 1e-15, cut
        assert relative(merged[3], float(exact_m2)) < 1e-14, cut
    # sqrt(E[x^2] - mean^2) on the float32 tensors is off by orders of magnitude, and even in float64 by ~1e-4.
    t = torch.from_numpy(x[:, 0])
    naive32 = ((t * t).mean() - t.mean() ** 2).clamp_min(0).sqrt().item()
    t64 = t.double()
    naive64 = ((t64 * t64).mean() - t64.mean() ** 2).clamp_min(0).sqrt().item()
    assert relative(naive32, exact_std) > 1.0
    assert relative(naive64, exact_std) > 1e-6
    assert relative(std_from_moments(count, m2), exact_std) < 1e-12


def test_merge_handles_empty_and_uneven_parts():
    x = torch.from_numpy(fields(50, seed=5)).double()
    whole = local_moments(x)
    for edges in [(0, 50), (0, 0, 50), (0, 50, 50), (0, 0, 3, 3, 50), (0, 1, 2, 49, 50)]:  # shard boundaries
        parts = torch.stack([local_moments(x[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)])
        merged = combine_moments(parts)
        assert merged[0].tolist() == [50.0] * 4, edges
        assert torch.allclose(merged[1], whole[1], rtol=1e-14, atol=0), edges
        assert torch.allclose(merged[3][:3], whole[3][:3], rtol=1e-12, atol=0), edges
    empty = local_moments(torch.zeros(0, 3))
    assert empty.tolist() == [[0.0] * 3] * 4
    assert torch.isnan(std_from_moments(empty[0], empty[3])).all()  # no data: NaN, not a made-up 1


def test_ignore_nan_counts_per_feature():
    x = torch.tensor([[1.0, 10.0], [float("nan"), 20.0], [3.0, float("inf")]])
    count, mean, residual, m2 = local_moments(x, ignore_nan=True)
    assert count.tolist() == [2.0, 2.0] and mean.tolist() == [2.0, 15.0] and m2.tolist() == [2.0, 50.0]
    assert residual.tolist() == [0.0, 0.0]
    assert not torch.isfinite(local_moments(x)[1]).any()  # by default a NaN or inf shows


def test_std_floor_and_ddof():
    count = torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)
    m2 = torch.tensor([12.0, 4e-13, 0.0], dtype=torch.float64)
    assert std_from_moments(count, m2).tolist() == [pytest.approx(3 ** 0.5), 1.0, 1.0]
    assert std_from_moments(count, m2, ddof=1)[0].item() == pytest.approx(2.0)
    assert std_from_moments(count, m2, floor=1e-9)[1].item() == pytest.approx((1e-13) ** 0.5)


SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from toolkit.process import begin_process
    begin_process()  # first: it ends the process group at exit (toolkit.process.shutdown)
    import numpy as np
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from toolkit.run.distributed import global_mean, mean_over_processes, merge_moments, std_from_moments
    from toolkit.run.metrics import error_metrics, masked_error_sums

    out = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    data = np.load(f"{out}/data.npz")
    x, pred, target = data["x"], data["pred"], data["target"]
    result = {"rank": rank, "num_processes": accelerator.num_processes, "world_size": dist.get_world_size(),
              "backend": dist.get_backend(), "cases": {},
              "mean_of_ranks": mean_over_processes(accelerator, torch.tensor([rank + 1.0])).tolist()}
    # global_mean over uneven item counts: rank 0 holds 1, 2, 3 and rank 1 holds 10; the global mean is 16 / 4
    items = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.tensor([10.0])
    loss, mean = global_mean(accelerator, items.sum(), len(items))
    result["global_mean"] = [loss.item(), mean.item()]
    for name, cut in json.load(open(f"{out}/cuts.json")).items():
        rows = slice(0, cut) if rank == 0 else slice(cut, len(x))
        count, mean, m2 = merge_moments(accelerator, torch.from_numpy(x[rows]))
        sums = masked_error_sums(torch.from_numpy(pred[rows]), torch.from_numpy(target[rows]))
        total = accelerator.reduce(sums, "sum")  # float64 through gloo
        result["cases"][name] = {"rows": len(x[rows]), "count": count.tolist(), "mean": mean.tolist(),
                                 "std": std_from_moments(count, m2).tolist(), "errors": error_metrics(total)}
    json.dump(result, open(f"{out}/rank{rank}.json", "w"))
    """
)


@pytest.mark.slow
def test_two_gloo_processes_equal_one_process(tmp_path, accelerator):
    rows = 3001
    x = fields(rows, seed=11)
    generator = np.random.default_rng(12)
    target = (generator.random((rows, 6)) * 70).astype(np.float32)
    target[target < 5] = 0.0  # missing readings
    pred = target + generator.standard_normal((rows, 6)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, pred=pred, target=target)
    cuts = {"uneven": rows - 3, "rank1-empty": rows, "rank0-fewer": 2, "halves": rows // 2}
    (tmp_path / "cuts.json").write_text(json.dumps(cuts))
    (tmp_path / "moments.py").write_text(SCRIPT)
    run_recipe([str(tmp_path)], config="cpu_2proc.yaml", recipe=str(tmp_path / "moments.py"), timeout=300)

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["num_processes"], r["world_size"], r["backend"]) for r in results] == [
        (0, 2, 2, "gloo"),
        (1, 2, 2, "gloo"),
    ]
    assert [r["mean_of_ranks"] for r in results] == [[1.5], [1.5]]  # (1 + 2) / 2 on each rank
    # each rank's loss is its sum x world size / global count, so DDP's average of the ranks' gradients is the
    # gradient of the global mean (6 x 2 / 4 and 10 x 2 / 4; their mean is 4): not each rank's own mean (2 and 10)
    assert [r["global_mean"] for r in results] == [[3.0, 4.0], [5.0, 4.0]]
    ref_mean, ref_std = two_pass(x)
    ref_std[3] = 1.0  # the constant field
    count, mean, m2 = merge_moments(accelerator, torch.from_numpy(x))  # one process, all rows
    single_errors = error_metrics(masked_error_sums(torch.from_numpy(pred), torch.from_numpy(target)))
    for name, cut in cuts.items():
        case = [r["cases"][name] for r in results]
        assert [c["rows"] for c in case] == [cut, rows - cut], name  # the shards really were uneven
        same = [{k: v for k, v in c.items() if k != "rows"} for c in case]
        assert same[0] == same[1], name  # every rank got the same bits
        assert case[0]["count"] == [float(rows)] * 4, name
        assert relative(case[0]["mean"], ref_mean) < 1e-12, name
        assert relative(case[0]["std"], ref_std) < 1e-12, name
        assert relative(case[0]["mean"], mean) < 1e-12, name
        assert relative(case[0]["std"], std_from_moments(count, m2)) < 1e-12, name
        errors = case[0]["errors"]
        assert errors["count"] == single_errors["count"] < target.size, name
        for metric in ["mae", "rmse", "mape"]:
            assert errors[metric] == pytest.approx(single_errors[metric], rel=1e-12), (name, metric)
