"""Generic data helpers: the atomic `datasets` cache (toolkit.data.cache) and TensorRows (toolkit.data.rows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from toolkit.data import cache
from toolkit.data.cache import cached_dataset, file_fingerprint, save_atomically, write_bytes_atomically
from toolkit.data.movielens import UserSequences
from toolkit.data.rows import TensorRows
from toolkit.errors import UsageError


class Builder:
    """build() for cached_dataset that counts its calls."""

    def __init__(self, values=(1, 2, 3), meta=None):
        self.values, self.meta, self.calls = list(values), meta or {"rows": len(values)}, 0

    def __call__(self):
        self.calls += 1
        return datasets.Dataset.from_dict({"x": self.values}), dict(self.meta)


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# ---- the cache -------------------------------------------------------------------------------------------------


def test_built_once_then_loaded_without_building(tmp_path):
    build = Builder(meta={"rows": 3, "source": "hand"})
    first, first_meta = cached_dataset(tmp_path, "toy", "k1", build)
    assert build.calls == 1 and first["x"] == [1, 2, 3] and first_meta == {"rows": 3, "source": "hand"}
    assert entries(tmp_path / "processed") == ["toy-k1"]
    assert entries(tmp_path / "processed" / "toy-k1") == ["dataset", "meta.json"]

    second, second_meta = cached_dataset(tmp_path, "toy", "k1", Builder(values=[9]))
    assert second["x"] == [1, 2, 3] and second_meta == first_meta  # loaded, not rebuilt
    other, _ = cached_dataset(tmp_path, "toy", "k2", build)  # another key is another build
    assert build.calls == 2 and other["x"] == [1, 2, 3]
    assert entries(tmp_path / "processed") == ["toy-k1", "toy-k2"]


def test_an_exception_in_build_leaves_nothing_that_is_loaded(tmp_path):
    def broken():
        raise RuntimeError("parse error")

    with pytest.raises(RuntimeError, match="parse error"):
        cached_dataset(tmp_path / "new" / "cache", "toy", "k", broken)
    assert list(tmp_path.iterdir()) == []  # a bad input creates nothing: the directories made are gone again
    (tmp_path / "processed").mkdir()
    with pytest.raises(RuntimeError, match="parse error"):
        cached_dataset(tmp_path, "toy", "k", broken)
    assert entries(tmp_path / "processed") == []  # a directory that was there stays
    build = Builder()
    ds, _ = cached_dataset(tmp_path, "toy", "k", build)
    assert build.calls == 1 and ds["x"] == [1, 2, 3]


def test_an_interrupted_save_is_never_loaded(tmp_path, monkeypatch):
    real_save = datasets.Dataset.save_to_disk

    def half_written(self, path, **kwargs):
        real_save(self, path, **kwargs)  # the data files are there, the build is not finished
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(datasets.Dataset, "save_to_disk", half_written)
        with pytest.raises(KeyboardInterrupt):
            cached_dataset(tmp_path, "toy", "k", Builder(values=[7, 7]))
    assert entries(tmp_path / "processed") == []  # the temporary directory was removed too
    build = Builder()
    ds, _ = cached_dataset(tmp_path, "toy", "k", build)
    assert build.calls == 1 and ds["x"] == [1, 2, 3]


def test_leftover_temporary_and_incomplete_directories_are_never_loaded(tmp_path):
    processed = tmp_path / "processed"
    # What a killed process leaves: a complete-looking temporary sibling, and a final name without meta.json.
    leftover = processed / ".toy-k.deadbeef.tmp"
    datasets.Dataset.from_dict({"x": [666]}).save_to_disk(str(leftover / "dataset"))
    (leftover / "meta.json").write_text(json.dumps({"rows": 1}))
    incomplete = processed / "toy-k"
    datasets.Dataset.from_dict({"x": [555]}).save_to_disk(str(incomplete / "dataset"))

    build = Builder()
    ds, meta = cached_dataset(tmp_path, "toy", "k", build)
    assert build.calls == 1 and ds["x"] == [1, 2, 3] and meta == {"rows": 3}
    assert (incomplete / "meta.json").is_file()


def test_a_concurrent_builder_that_finishes_first_wins(tmp_path):
    final = tmp_path / "processed" / "toy-k"

    def racing():
        # Another process completes the same build while this one is still building.
        save_atomically(datasets.Dataset.from_dict({"x": [4, 5]}), {"rows": 2, "by": "other"}, final)
        return datasets.Dataset.from_dict({"x": [1, 2, 3]}), {"rows": 3, "by": "us"}

    ds, meta = cached_dataset(tmp_path, "toy", "k", racing)
    assert ds["x"] == [4, 5] and meta == {"rows": 2, "by": "other"}  # one build, whole, the first to finish
    assert entries(tmp_path / "processed") == ["toy-k"]  # our temporary directory is gone


@pytest.mark.parametrize("where", ["proc", "file"])
def test_an_unusable_cache_dir_is_one_line_naming_the_flag(tmp_path, where):
    # Tests run as root, so permission bits do not stop writes: /proc refuses new directories for anyone.
    if where == "proc":
        cache_dir = Path("/proc") / f"toolkit-cache-test-{os.getpid()}"
    else:
        cache_dir = tmp_path / "a-file"
        cache_dir.write_text("not a directory\n")
    build = Builder()
    with pytest.raises(UsageError) as caught:
        cached_dataset(cache_dir, "toy", "k", build, flag="--data-cache")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--data-cache {cache_dir} is not a writable directory")
    assert "pass a directory you can write to" in message
    assert build.calls == 0  # refused before a possibly long build


def test_a_complete_cache_is_loaded_without_writing(tmp_path, monkeypatch):
    cached_dataset(tmp_path, "toy", "k", Builder())

    def no_writes(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(Path, "mkdir", no_writes)  # a read-only cache directory
    ds, _ = cached_dataset(tmp_path, "toy", "k", Builder(values=[0]))
    assert ds["x"] == [1, 2, 3]


def test_file_fingerprint_names_the_content_and_the_version(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"1\t2\t3\t4\n")
    b.write_bytes(b"1\t2\t3\t4\n")
    key = file_fingerprint(a, 1)
    assert len(key) == 16 and int(key, 16) >= 0
    assert file_fingerprint(b, 1) == key  # the path does not matter, the content does
    assert file_fingerprint(a, 2) != key
    b.write_bytes(b"1\t2\t3\t5\n")
    assert file_fingerprint(b, 1) != key


def test_write_bytes_atomically_leaves_no_partial_files(tmp_path, monkeypatch):
    target = tmp_path / "raw" / "file.bin"
    write_bytes_atomically(target, b"first")
    assert target.read_bytes() == b"first" and entries(target.parent) == ["file.bin"]

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_bytes_atomically(target, b"second")
    assert target.read_bytes() == b"first" and entries(target.parent) == ["file.bin"]


# ---- TensorRows ------------------------------------------------------------------------------------------------


def test_tensor_rows_items_and_batches():
    fields = {"x": torch.arange(12).view(4, 3), "y": torch.tensor([10.0, 11.0, 12.0, 13.0])}
    every = TensorRows(fields)
    assert len(every) == 4
    item = every[1]
    assert set(item) == {"index", "x", "y"}
    assert item["index"].item() == 1 and item["x"].tolist() == [3, 4, 5] and item["y"].item() == 11.0
    some = TensorRows(fields, rows=[3, 0, 3], index_name="window")  # any order, repeats allowed
    assert len(some) == 3
    batch = next(iter(DataLoader(some, batch_size=3)))
    assert batch["window"].tolist() == [3, 0, 3]
    assert batch["x"].tolist() == [[9, 10, 11], [0, 1, 2], [9, 10, 11]] and batch["y"].tolist() == [13.0, 10.0, 13.0]
    assert len(TensorRows(fields, rows=torch.tensor([], dtype=torch.long))) == 0


@pytest.mark.parametrize(
    "fields, rows, index_name, match",
    [
        ({}, None, "index", "non-empty"),
        ({"a": torch.zeros(3), "b": torch.zeros(4)}, None, "index", "equally long"),
        ({"user": torch.zeros(3)}, None, "user", "'user' is added"),
        ({"a": torch.zeros(3)}, [0, 3], "index", r"rows must be in 0\.\.2"),
        ({"a": torch.zeros(3)}, [-1], "index", r"rows must be in 0\.\.2"),
        ({"a": torch.zeros(3)}, torch.tensor([0.0, 1.0]), "index", "integer row numbers"),
        ({"a": torch.zeros(3)}, torch.tensor([True, False, True]), "index", "integer row numbers"),
    ],
    ids=["empty", "unequal", "name-clash", "too-large", "negative", "float-rows", "mask-as-rows"],
)
def test_tensor_rows_refuses_bad_arguments(fields, rows, index_name, match):
    with pytest.raises(ValueError, match=match):
        TensorRows(fields, rows=rows, index_name=index_name)


def test_user_sequences_is_tensor_rows_by_user():
    fields = {"input": torch.arange(8).view(4, 2)}
    users = UserSequences(fields, users=torch.tensor([2, 0]))
    assert isinstance(users, TensorRows) and users.users.tolist() == [2, 0]
    assert [users[i]["user"].item() for i in range(2)] == [2, 0] and users[0]["input"].tolist() == [4, 5]
    with pytest.raises(ValueError, match="'user' is added by UserSequences"):
        UserSequences({"user": torch.zeros(2)})
