"""MovieLens data: parsing of the three raw formats, the `datasets` cache, leave-one-out split, errors."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from toolkit.data import movielens
from toolkit.data.movielens import UserSequences, leave_one_out, prepare_movielens
from toolkit.errors import UsageError

# Original ids: users 7, 42, 1000 -> 0, 1, 2 (numeric order, also from a .inter file whose ids are text);
# items 11..18 -> 1..8. Lines are out of chronological order; user 7 has two timestamp ties whose file order
# (item 15 before 13 at t=100, item 12 before 16 at t=250) must survive.
RAW = [  # (user, item, rating, timestamp) in file order
    (42, 18, 4, 500),
    (7, 17, 5, 400),
    (7, 15, 3, 100),
    (1000, 13, 2, 40),
    (7, 13, 1, 100),
    (7, 11, 4, 130),
    (1000, 11, 5, 10),
    (7, 14, 2, 175),
    (42, 12, 3, 500),
    (7, 12, 5, 250),
    (1000, 12, 4, 20),
    (7, 16, 3, 250),
]
EXPECTED_ITEMS = [[5, 3, 1, 4, 2, 6, 7], [8, 2], [1, 2, 3]]
EXPECTED_TIMES = [[100, 100, 130, 175, 250, 250, 400], [500, 500], [10, 20, 40]]


def write_udata(path: Path) -> Path:
    path.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RAW))
    return path


def write_ratings_dat(path: Path) -> Path:
    path.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in RAW))
    return path


def write_inter(path: Path) -> Path:
    header = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    path.write_text(header + "".join(f"{u}\t{i}\t{r}.0\t{t}.0\n" for u, i, r, t in RAW))
    return path


def columns(ds: datasets.Dataset) -> dict:
    return {name: ds[name] for name in ["user", "items", "timestamps"]}


# ---- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "write, name",
    [(write_udata, "u.data"), (write_ratings_dat, "ratings.dat"), (write_inter, "ml-100k.inter")],
)
def test_every_format_parses_into_the_same_chronological_sequences(write, name, tmp_path):
    raw = write(tmp_path / name)
    ds, meta = prepare_movielens("ml-100k", raw, tmp_path / "cache")
    assert columns(ds) == {"user": [0, 1, 2], "items": EXPECTED_ITEMS, "timestamps": EXPECTED_TIMES}
    assert meta.pop("fingerprint").startswith("ml-100k-")  # the cache key: a hash of the raw file
    assert meta == {
        "num_users": 3,
        "num_items": 8,
        "num_interactions": len(RAW),
        "source": str(raw),
        "dataset": "ml-100k",
    }


def test_a_directory_is_searched_for_a_known_file(tmp_path):
    write_ratings_dat(tmp_path / "ratings.dat")
    (tmp_path / "README").write_text("not ratings\n")
    ds, meta = prepare_movielens("ml-1m", tmp_path, tmp_path / "cache")
    assert ds["items"] == EXPECTED_ITEMS
    assert meta["source"] == str(tmp_path / "ratings.dat") and meta["dataset"] == "ml-1m"


def test_grouplens_zip_is_stored_as_a_raw_inter_file(tmp_path, monkeypatch):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("ml-100k/u.data", write_udata(tmp_path / "u.data").read_text())

    class Response(io.BytesIO):
        def __exit__(self, *exc):
            return False

    fake_urlopen = lambda url, timeout: Response(archive.getvalue())  # noqa: E731
    monkeypatch.setattr(movielens.urllib.request, "urlopen", fake_urlopen)
    ds, meta = prepare_movielens("ml-100k", None, tmp_path / "cache")
    assert ds["items"] == EXPECTED_ITEMS and ds["timestamps"] == EXPECTED_TIMES
    assert meta["source"] == f"{tmp_path / 'cache' / 'raw' / 'ml-100k.inter'} ({movielens.GROUPLENS_100K})"
    assert movielens._sniff_format(tmp_path / "cache" / "raw" / "ml-100k.inter") == "inter"


# ---- leave-one-out ---------------------------------------------------------------------------------------


def hand_made(order=(0, 1, 2)) -> tuple[datasets.Dataset, dict]:
    rows = {
        "user": list(order),
        "items": [EXPECTED_ITEMS[u] for u in order],
        "timestamps": [EXPECTED_TIMES[u] for u in order],
    }
    return datasets.Dataset.from_dict(rows), {"num_users": 3, "num_items": 8, "num_interactions": 12}


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_leave_one_out_on_a_hand_made_example(order):
    # User 0: 7 items, times scaled by the smallest non-zero gap 30 (ties give 0 gaps; 75/30 = 2.5 rounds to
    # even): [1, 1, 2, 3, 6, 6, 11]. User 1: 2 items at the same time (scale 1), not evaluated.
    # User 2: 3 items at 10, 20, 40 (scale 10): [1, 2, 4]; its only training item gives no training pair.
    split = leave_one_out(*hand_made(order), maxlen=3)
    long = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
    assert (split.num_users, split.num_items, split.maxlen) == (3, 8, 3)
    assert torch.equal(split.train_input, long([[3, 1, 4], [0, 0, 8], [0, 0, 0]]))
    assert torch.equal(split.train_target, long([[1, 4, 2], [0, 0, 2], [0, 0, 0]]))
    assert torch.equal(split.train_time, long([[1, 2, 3], [0, 0, 1], [0, 0, 0]]))
    assert torch.equal(split.valid_input, long([[1, 4, 2], [0, 8, 2], [0, 0, 1]]))
    assert torch.equal(split.valid_time, long([[2, 3, 6], [0, 1, 1], [0, 0, 1]]))
    assert torch.equal(split.valid_target, long([6, 0, 2]))
    assert torch.equal(split.test_input, long([[4, 2, 6], [0, 8, 2], [0, 1, 2]]))
    assert torch.equal(split.test_time, long([[3, 6, 6], [0, 1, 1], [0, 1, 2]]))
    assert torch.equal(split.test_target, long([7, 0, 3]))
    assert torch.equal(split.eval_users, long([0, 2]))
    touched = torch.zeros(3, 9, dtype=torch.bool)
    touched[0, 1:8] = True
    touched[1, [2, 8]] = True
    touched[2, [1, 2, 3]] = True
    assert torch.equal(split.touched, touched)
    for name in [
        "train_input",
        "train_target",
        "train_time",
        "valid_input",
        "valid_time",
        "test_input",
        "test_time",
        "valid_target",
        "test_target",
        "touched",
        "eval_users",
    ]:
        tensor = getattr(split, name)
        assert tensor.device.type == "cpu"
        assert tensor.dtype == (torch.bool if name == "touched" else torch.long), name


def test_leave_one_out_pads_on_the_left_when_maxlen_exceeds_the_history():
    split = leave_one_out(*hand_made(), maxlen=8)
    assert split.train_input[0].tolist() == [0, 0, 0, 0, 5, 3, 1, 4]
    assert split.train_target[0].tolist() == [0, 0, 0, 0, 3, 1, 4, 2]
    assert split.train_time[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    assert split.test_input[0].tolist() == [0, 0, 5, 3, 1, 4, 2, 6]
    assert split.test_time[0].tolist() == [0, 0, 1, 1, 2, 3, 6, 6]


def test_user_sequences_rows_and_batches():
    fields = {"input": torch.arange(12).view(4, 3), "target": torch.tensor([10, 11, 12, 13])}
    everyone = UserSequences(fields)
    assert len(everyone) == 4
    row = everyone[2]
    assert row["user"].item() == 2 and row["input"].tolist() == [6, 7, 8] and row["target"].item() == 12
    some = UserSequences(fields, users=torch.tensor([3, 1]))
    batch = next(iter(DataLoader(some, batch_size=2)))
    assert batch["user"].tolist() == [3, 1]
    assert batch["input"].tolist() == [[9, 10, 11], [3, 4, 5]] and batch["target"].tolist() == [13, 11]


# ---- the processed cache ---------------------------------------------------------------------------------


def test_second_call_loads_the_cache_and_ignores_leftover_temporary_dirs(tmp_path, monkeypatch):
    raw = write_udata(tmp_path / "u.data")
    cache = tmp_path / "cache"
    final = cache / "processed" / f"ml-100k-{movielens._cache_key(raw)}"
    leftover = final.with_name(f".{final.name}.deadbeef.tmp")  # what an interrupted build leaves behind
    (leftover / "dataset").mkdir(parents=True)
    (leftover / "meta.json").write_text(json.dumps({"num_users": 99}))

    first, first_meta = prepare_movielens("ml-100k", raw, cache)
    assert first_meta["num_users"] == 3 and (final / "meta.json").is_file()

    def no_parsing(path):
        raise AssertionError("the raw file was parsed again instead of loading the cache")

    monkeypatch.setattr(movielens, "_read_ratings", no_parsing)
    second, second_meta = prepare_movielens("ml-100k", raw, cache)
    assert columns(second) == columns(first) and second_meta == first_meta


def test_an_interrupted_build_is_never_loaded(tmp_path, monkeypatch):
    raw = write_udata(tmp_path / "u.data")
    cache = tmp_path / "cache"

    def interrupted(src, dst):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(movielens.os, "rename", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare_movielens("ml-100k", raw, cache)
    assert list((cache / "processed").iterdir()) == []
    ds, _ = prepare_movielens("ml-100k", raw, cache)
    assert ds["items"] == EXPECTED_ITEMS


def test_a_changed_raw_file_is_rebuilt(tmp_path):
    raw = write_udata(tmp_path / "u.data")
    prepare_movielens("ml-100k", raw, tmp_path / "cache")
    with raw.open("a") as handle:
        handle.write("7\t19\t5\t900\n")
    ds, meta = prepare_movielens("ml-100k", raw, tmp_path / "cache")
    assert meta["num_items"] == 9 and ds["items"][0][-1] == 9
    assert len(list((tmp_path / "cache" / "processed").iterdir())) == 2


# ---- errors ----------------------------------------------------------------------------------------------


def usage_error(*args) -> str:
    with pytest.raises(UsageError) as caught:
        prepare_movielens(*args)
    message = str(caught.value)
    assert "\n" not in message and "--data-path" in message, message
    return message


def test_user_errors_are_one_line_and_name_the_flag(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert str(tmp_path / "nope") in usage_error("ml-100k", tmp_path / "nope", cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello\n")
    assert "u.data, ratings.dat or a *.inter" in usage_error("ml-100k", empty, cache)
    assert "not a MovieLens ratings file" in usage_error("ml-100k", empty / "notes.txt", cache)
    bad_time = tmp_path / "bad.data"
    bad_time.write_text("1\t2\t3\t100\n1\t3\t3\tsoon\n")
    assert "line 2" in usage_error("ml-100k", bad_time, cache)
    message = usage_error("ml-1m", None, cache)
    assert "--dataset ml-1m" in message and "ratings.dat" in message

    def offline():
        raise OSError("offline")

    monkeypatch.setattr(movielens, "_fetch_grouplens_100k", offline)
    monkeypatch.setattr(movielens, "_fetch_recbole_100k", offline)
    message = usage_error("ml-100k", None, cache)
    assert movielens.GROUPLENS_100K in message and "recbole" in message
    assert not (cache / "raw" / "ml-100k.inter").exists()


# ---- the real MovieLens-100K -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ml100k_cache(tmp_path_factory) -> Path:
    """MovieLens-100K fetched once per session (GroupLens, or the recbole wheel from PyPI)."""
    cache = tmp_path_factory.mktemp("movielens-cache")
    prepare_movielens("ml-100k", None, cache)
    return cache


def reference_split(items: list[int], times: list[int], maxlen: int) -> dict:
    """The SASRec/TiSASRec split of one user, written plainly."""
    ordered = sorted(times)
    gaps = [b - a for a, b in zip(ordered[:-1], ordered[1:], strict=True) if b != a]
    scale = min(gaps) if gaps else 1
    scaled = [round((t - min(times)) / scale) + 1 for t in times]

    def pad(values):
        values = values[-maxlen:] if values else []
        return [0] * (maxlen - len(values)) + values

    n = len(items)
    k = n - 2 if n >= 3 else n
    history = k + 1 if n >= 3 else k
    return {
        "train_input": pad(items[: k - 1]),
        "train_target": pad(items[1:k]),
        "train_time": pad(scaled[: k - 1]),
        "valid_input": pad(items[:k]),
        "valid_time": pad(scaled[:k]),
        "test_input": pad(items[:history]),
        "test_time": pad(scaled[:history]),
        "valid_target": items[-2] if n >= 3 else 0,
        "test_target": items[-1] if n >= 3 else 0,
    }


def test_real_movielens_100k(ml100k_cache, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the raw ML-100K should come from the cache")

    monkeypatch.setattr(movielens.urllib.request, "urlopen", no_network)
    monkeypatch.setattr(movielens.subprocess, "run", no_network)
    ds, meta = prepare_movielens("ml-100k", None, ml100k_cache)
    assert (meta["num_users"], meta["num_items"], meta["num_interactions"]) == (943, 1682, 100_000)
    assert meta["dataset"] == "ml-100k" and "ml-100k.inter" in meta["source"]
    all_items, all_times = ds["items"], ds["timestamps"]
    assert ds["user"] == list(range(943)) and min(map(len, all_items)) >= 20
    assert {i for items in all_items for i in items} == set(range(1, 1683))
    assert all(times == sorted(times) for times in all_times)

    maxlen = 50
    split = leave_one_out(ds, meta, maxlen)
    assert split.eval_users.tolist() == list(range(943))
    assert split.touched.sum().item() == len({(u, i) for u, items in enumerate(all_items) for i in items})
    assert not split.touched[:, 0].any()
    for user in range(0, 943, 7):
        expected = reference_split(all_items[user], all_times[user], maxlen)
        for name, value in expected.items():
            assert getattr(split, name)[user].tolist() == value, (user, name)
