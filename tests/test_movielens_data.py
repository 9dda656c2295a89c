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

from toolkit.data import cache as data_cache
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
        "train_touched",
        "eval_users",
    ]:
        tensor = getattr(split, name)
        assert tensor.device.type == "cpu"
        assert tensor.dtype == (torch.bool if name.endswith("touched") else torch.long), name


def test_leave_one_out_pads_on_the_left_when_maxlen_exceeds_the_history():
    split = leave_one_out(*hand_made(), maxlen=8)
    assert split.train_input[0].tolist() == [0, 0, 0, 0, 5, 3, 1, 4]
    assert split.train_target[0].tolist() == [0, 0, 0, 0, 3, 1, 4, 2]
    assert split.train_time[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    assert split.test_input[0].tolist() == [0, 0, 5, 3, 1, 4, 2, 6]
    assert split.test_time[0].tolist() == [0, 0, 1, 1, 2, 3, 6, 6]


def test_training_negatives_may_be_held_out_items():
    # SASRec's code draws training negatives from outside the user's TRAINING items: train_touched marks those;
    # touched (for evaluation) marks everything. User 0: training part [5, 3, 1, 4, 2], valid 6, test 7.
    # User 1 (2 items) trains on both. User 2: training part [1, 2, 1], valid 3, test 1 (also a training item).
    rows = {"user": [0, 1, 2], "items": [EXPECTED_ITEMS[0], [8, 2], [1, 2, 1, 3, 1]],
            "timestamps": [EXPECTED_TIMES[0], [500, 500], [1, 2, 3, 4, 5]]}
    split = leave_one_out(datasets.Dataset.from_dict(rows), {"num_users": 3, "num_items": 8}, maxlen=4)
    marked = lambda table, user: torch.nonzero(table[user]).flatten().tolist()  # noqa: E731
    assert marked(split.train_touched, 0) == [1, 2, 3, 4, 5]
    assert marked(split.touched, 0) == [1, 2, 3, 4, 5, 6, 7]
    assert marked(split.train_touched, 1) == marked(split.touched, 1) == [2, 8]
    assert marked(split.train_touched, 2) == [1, 2] and marked(split.touched, 2) == [1, 2, 3]
    assert not split.train_touched[:, 0].any()
    assert split.train_touched.shape == split.touched.shape == (3, 9)
    assert not (split.train_touched & ~split.touched).any()


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
        patch.setattr(data_cache.os, "rename", interrupted)
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


BAD_FILES = {  # name: (content, what the one-line message must say besides the path)
    "two-rows": ("u.data", b"1\t2\t3\t100\n1\t3\t3\t200\n",
                 ["holds 2 ratings of 1 user", "a user with 3 or more ratings"]),
    "three-rows": ("u.data", b"1\t2\t3\t100\n1\t3\t3\t200\n1\t4\t3\t300\n",
                   ["holds 3 ratings of 1 user", "4 or more", "nothing is left to train on"]),
    "non-numeric-user-u.data": ("u.data", b"1\t2\t3\t100\n1\t3\t3\t200\nbob\t4\t3\t300\n1\t5\t3\t400\n",
                                ["line 3:", "user id 'bob' is not an integer", "u.data files hold integer"]),
    "non-numeric-item-ratings.dat": ("ratings.dat", b"1::2::3::100\n1::3::3::200\n1::4::3::300\n1::x5::3::400\n",
                                     ["line 4:", "item id 'x5' is not an integer", "ratings.dat files hold integer"]),
    "fractional-user": ("u.data", b"1\t2\t3\t100\n1.5\t3\t3\t200\n", ["line 2:", "user id 1.5 is not an integer"]),
    "negative-item": ("u.data", b"1\t2\t3\t100\n1\t3\t3\t200\n1\t-4\t3\t300\n",
                      ["line 3:", "item id -4 is negative", "non-negative integers"]),
    "negative-user": ("ratings.dat", b"1::2::3::100\n-1::3::3::200\n", ["line 2:", "user id -1 is negative"]),
    "line-numbers-count-blank-lines": ("u.data", b"1\t2\t3\t100\r\n\r\n\n1\t3\t3\t200\r\nx\t4\t3\t300\r\n",
                                       ["line 5:", "user id 'x'"]),
    "empty": ("u.data", b"", ["is empty"]),
    "only-blank-lines": ("u.data", b"\n\r\n\n", ["is empty"]),
    "binary-garbage": ("u.data", bytes(range(256)) * 16, ["is a binary file"]),
    "binary-after-good-lines": ("u.data", b"1\t2\t3\t100\n" * 7000 + b"1\t\xff\xfe\t3\t5\n",
                                ["line 7001:", "binary data (byte 0xff)"]),
    "text-not-ratings": ("notes.txt", b"Dear diary,\ntoday I rated movies.\n",
                         ["is not a MovieLens ratings file (first line 'Dear diary,')"]),
    "csv-ratings": ("ratings.csv", b"userId,movieId,rating,timestamp\n1,2,3.5,100\n",
                    ["is not a MovieLens ratings file"]),
    "too-few-fields": ("u.data", b"1\t2\t3\t100\n1\t3\n", ["line 2 has 2 fields", "u.data lines have 4"]),
    "too-many-fields": ("ratings.dat", b"1::2::3::100\n1::3::3::200::9\n",
                        ["line 2 has 5 fields", "ratings.dat lines have 4 (user::item::rating::timestamp)"]),
    "inter-short-row": ("x.inter", movielens.INTER_HEADER.encode() + b"u\ti\t3\t1\nu\tj\n",
                        ["line 3 has 2 fields", "as many as its header line"]),
    "missing-timestamp": ("u.data", b"1\t2\t3\t100\n1\t3\t3\t\n", ["line 2:", "no timestamp value"]),
    "bad-timestamp": ("u.data", b"1\t2\t3\t100\n1\t3\t3\tsoon\n", ["line 2:", "timestamp 'soon' is not a number"]),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_ratings_files_are_one_line_naming_the_path(case, tmp_path):
    name, content, expected = BAD_FILES[case]
    path = tmp_path / name
    path.write_bytes(content)
    message = usage_error("ml-100k", path, tmp_path / "cache")
    assert message.startswith(f"--data-path {path} "), message
    for phrase in expected:
        assert phrase in message, (phrase, message)
    assert not (tmp_path / "cache" / "processed").exists() or not any((tmp_path / "cache" / "processed").iterdir())


def test_valid_files_with_blank_lines_and_crlf_parse(tmp_path):
    raw = tmp_path / "u.data"
    raw.write_bytes(b"\r\n" + "".join(f"{u}\t{i}\t{r}\t{t}\r\n\n" for u, i, r, t in RAW).encode())
    ds, meta = prepare_movielens("ml-100k", raw, tmp_path / "cache")
    assert columns(ds) == {"user": [0, 1, 2], "items": EXPECTED_ITEMS, "timestamps": EXPECTED_TIMES}


def test_an_unusable_cache_dir_names_the_flag(tmp_path):
    raw = write_udata(tmp_path / "u.data")
    cache_dir = Path("/proc") / "toolkit-movielens-cache-test"  # root may write anywhere else
    with pytest.raises(UsageError) as caught:
        prepare_movielens("ml-100k", raw, cache_dir)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--cache-dir {cache_dir} is not a writable directory")


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
