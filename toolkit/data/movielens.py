"""MovieLens for sequential recommendation: raw ratings -> per-user chronological sequences -> leave-one-out.

    ds, meta = prepare_movielens("ml-100k", None, Path("~/.cache/accelerate-recipes").expanduser())
    split = leave_one_out(ds, meta, maxlen=200)
    train_set = UserSequences({"input": split.train_input, "target": split.train_target}, users=None)

Raw ratings come from --data-path (MovieLens u.data, ratings.dat or a RecBole .inter file, or a directory
holding one); without it ML-100K is fetched once into <cache_dir>/raw (GroupLens, else the ml-100k.inter
shipped in the recbole wheel on PyPI). The per-user sequences are built once and kept as a `datasets` dataset
under <cache_dir>/processed/<dataset>-<key>, key = hash of the raw file and FORMAT_VERSION (toolkit.data.cache: a
build is written to a temporary sibling directory and renamed when complete, so an interrupted build is never
loaded). Malformed input (empty, binary, not ratings, wrong field counts, non-integer or negative ids, too few
ratings) is a one-line UsageError naming the path and, where it applies, the line.
"""

from __future__ import annotations

import codecs
import csv
import io
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from toolkit.data.cache import cached_dataset, file_fingerprint, writable, write_bytes_atomically
from toolkit.data.prepared import Prepared, require_path
from toolkit.data.rows import TensorRows
from toolkit.errors import UsageError

FORMAT_VERSION = 2  # bump when the processed layout or the parsing changes: old caches are then rebuilt
DATASETS = ("ml-100k", "ml-1m")
GROUPLENS_100K = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
GROUPLENS_1M = "https://files.grouplens.org/datasets/movielens/ml-1m.zip"
RECBOLE_WHEEL = "recbole==1.2.1"
RECBOLE_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
INTER_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
VALID_INPUT = "give MovieLens u.data, ratings.dat or a RecBole .inter file (or omit it for ml-100k)"


# ----------------------------------------------------------------------------------------------------
# Raw files: find, fetch, parse
# ----------------------------------------------------------------------------------------------------


def _first_line(path: Path) -> str:
    """The first line that is not empty (a ratings file may start with blank lines), without its line end."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    for raw in head.split(b"\n"):
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        if line:
            return line[:4096]
    return ""


def _is_binary(path: Path) -> bool:
    """NUL bytes or invalid UTF-8 in the first 64 KiB: not a text file."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def _sniff_format(path: Path) -> Literal["udata", "dat", "inter"] | None:
    """The format of a ratings file from its first non-empty line, whatever its name."""
    line = _first_line(path)
    if "::" in line:
        fields = line.split("::")
        ids_ok = all(f.strip().lstrip("-").isdigit() for f in fields[:2])
        return "dat" if len(fields) >= 4 and ids_ok else None
    fields = line.split("\t")
    names = [f.split(":")[0].strip() for f in fields]
    if {"user_id", "item_id", "timestamp"} <= set(names):
        return "inter"
    if len(fields) >= 4 and all(_is_number(f) for f in fields[:4]):
        return "udata"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _resolve_data_path(data_path: Path) -> Path:
    """A ratings file from --data-path (a file, or a directory holding u.data, ratings.dat or one *.inter)."""
    require_path(data_path, "--data-path", VALID_INPUT)
    path = Path(data_path).expanduser()
    if path.is_dir():
        candidates = [path / "u.data", path / "ratings.dat"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            inter = sorted(p for p in path.glob("*.inter") if p.is_file())
            if len(inter) > 1:
                names = ", ".join(p.name for p in inter)
                raise UsageError(
                    f"--data-path {data_path} holds several .inter files ({names}); pass one of them"
                )
            found = inter
        if not found:
            raise UsageError(
                f"--data-path {data_path} is a directory without u.data, ratings.dat or a *.inter file; "
                f"{VALID_INPUT}"
            )
        path = found[0]
    if not path.is_file():
        raise UsageError(f"--data-path {data_path} is not a regular file; {VALID_INPUT}")
    try:
        if path.stat().st_size == 0 or not _first_line(path):
            raise UsageError(f"--data-path {path} is empty (no ratings); {VALID_INPUT}")
        if _is_binary(path):
            raise UsageError(f"--data-path {path} is a binary file, not a text file of ratings; {VALID_INPUT}")
        kind = _sniff_format(path)
    except PermissionError as error:
        raise UsageError(f"--data-path {path} cannot be read ({error.strerror}); {VALID_INPUT}") from None
    if kind is None:
        first = _first_line(path)[:60]
        raise UsageError(
            f"--data-path {path} is not a MovieLens ratings file (first line {first!r}); {VALID_INPUT}"
        )
    return path


def _fetch_grouplens_100k() -> bytes:
    """u.data from the GroupLens zip, as a RecBole .inter file (header + the same tab-separated rows)."""
    with urllib.request.urlopen(GROUPLENS_100K, timeout=5) as response:
        archive = response.read()
    with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
        rows = zipped.read("ml-100k/u.data")
    return INTER_HEADER.encode() + rows


def _fetch_recbole_100k() -> bytes:
    """ml-100k.inter out of the recbole wheel on PyPI (a wheel is a zip; nothing is installed)."""
    with tempfile.TemporaryDirectory(prefix="recbole-wheel-") as tmpdir:
        pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command = [*pip_download, RECBOLE_WHEEL, "-d", tmpdir]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise RuntimeError("pip download timed out after 300 s") from None
        wheels = sorted(Path(tmpdir).glob("recbole-*.whl"))
        if result.returncode != 0 or not wheels:
            lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
            last = lines[-1] if lines else "no output"
            raise RuntimeError(f"pip download exited {result.returncode}: {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            return wheel.read(RECBOLE_MEMBER)


def _ml100k_raw(cache_dir: Path) -> tuple[Path, str]:
    """<cache_dir>/raw/ml-100k.inter, fetched on first use; returns (path, where it came from)."""
    target = cache_dir / "raw" / "ml-100k.inter"
    origin_file = target.with_name(target.name + ".source")
    if target.is_file():
        origin = origin_file.read_text().strip() if origin_file.is_file() else "fetched earlier"
        return target, f"{target} ({origin})"
    failures = []
    for origin, fetch in [
        (GROUPLENS_100K, _fetch_grouplens_100k),
        (f"{RECBOLE_WHEEL} wheel from PyPI", _fetch_recbole_100k),
    ]:
        try:
            data = fetch()
        except Exception as error:  # noqa: BLE001 - any failure means: try the next source
            failures.append(f"{origin}: {' '.join(str(error).split())[:200] or type(error).__name__}")
            continue
        write_bytes_atomically(target, data)
        write_bytes_atomically(origin_file, origin.encode())
        return target, f"{target} ({origin})"
    raise UsageError(
        f"--dataset ml-100k could not be fetched (tried {'; '.join(failures)}); download {GROUPLENS_100K}, "
        "unzip it and pass --data-path .../ml-100k/u.data"
    )


FORMAT_NAMES = {"udata": "u.data", "dat": "ratings.dat", "inter": "RecBole .inter"}
FIELD_LAYOUT = {"udata": "user<TAB>item<TAB>rating<TAB>timestamp", "dat": "user::item::rating::timestamp"}


def _line_table(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per line of data (split at newlines): start offset, end offset (before a CR LF or LF), number of
    tab-separated fields. Vectorised: ML-1M's million lines take milliseconds."""
    codes = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(codes == 10)
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [len(codes)]])
    if starts[-1] == len(codes):  # the file ends with a line end: no line after it
        starts, ends = starts[:-1], ends[:-1]
    carriage = np.zeros(len(ends), dtype=bool)
    nonempty = ends > starts
    carriage[nonempty] = codes[ends[nonempty] - 1] == 13
    ends = ends - carriage
    tabs = np.flatnonzero(codes == 9)
    fields = np.searchsorted(tabs, ends) - np.searchsorted(tabs, starts) + 1
    return starts, ends, fields


def _read_ratings(path: Path) -> pd.DataFrame:
    """user, item, timestamp columns in file order, whatever the format; a UsageError naming the line for
    anything that is not a well-formed rating (blank lines are skipped)."""
    kind = _sniff_format(path)
    if kind is None:
        raise UsageError(f"--data-path {path} is not a MovieLens ratings file; {VALID_INPUT}")
    name = FORMAT_NAMES[kind]
    data = path.read_bytes()
    bad_byte = data.find(b"\0")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_byte = error.start if bad_byte < 0 else min(bad_byte, error.start)
    if bad_byte >= 0:
        line = data.count(b"\n", 0, bad_byte) + 1
        raise UsageError(
            f"--data-path {path} line {line}: binary data (byte 0x{data[bad_byte]:02x}), not text; {name} files are "
            "text, one rating per line"
        )
    if kind == "dat":  # "::" is two characters, which only pandas' slow python engine splits on
        data = data.replace(b"::", b"\t")
    data = data.replace(b"\r\n", b"\n")  # a stray "\r" elsewhere stays in its field (and is reported there)
    starts, ends, fields = _line_table(data)
    lines = np.flatnonzero(ends > starts)  # 0-based numbers of the non-blank lines
    if kind == "inter":
        header, lines = lines[0], lines[1:]
        expected = int(fields[header])
        layout = f"{expected}, as many as its header line"
    else:
        expected, layout = 4, f"4 ({FIELD_LAYOUT[kind]})"
    if len(lines) == 0:
        raise UsageError(f"--data-path {path} holds no ratings; {VALID_INPUT}")
    malformed = lines[fields[lines] != expected]
    if len(malformed):
        line = int(malformed[0])
        count = int(fields[line])
        raise UsageError(
            f"--data-path {path} line {line + 1} has {count} field{'s' if count != 1 else ''}; {name} lines have "
            f"{layout}"
        )
    if len(lines) != len(starts) - (kind == "inter"):  # blank lines: leave them out, keep the line numbers
        kept = lines if kind != "inter" else np.concatenate([[header], lines])
        data = b"\n".join(data[starts[i]:ends[i]] for i in kept.tolist())
    line_of_row = lines + 1  # 1-based line number of each parsed row
    # No NA parsing ("NA" is not a missing value here), no quoting (a '"' is a character), "\n" ends lines only.
    read = dict(sep="\t", keep_default_na=False, na_filter=False, quoting=csv.QUOTE_NONE, lineterminator="\n")
    try:
        if kind == "inter":  # tokens are text: "007" stays "007"
            frame = pd.read_csv(io.BytesIO(data), header=0, dtype=str, **read)
            frame.columns = [str(c).split(":")[0].strip() for c in frame.columns]
            frame = frame[["user_id", "item_id", "timestamp"]]
        else:  # integer columns parse fast in C; a column holding anything else comes back as text
            frame = pd.read_csv(io.BytesIO(data), header=None, usecols=[0, 1, 3], **read)
    except (ValueError, KeyError, pd.errors.ParserError) as error:
        reason = " ".join(str(error).split())[:120]
        raise UsageError(f"--data-path {path} could not be parsed ({reason}); {VALID_INPUT}") from None
    frame.columns = ["user", "item", "timestamp"]
    if len(frame) != len(line_of_row):  # cannot happen with the checks above; never name a wrong line
        raise UsageError(f"--data-path {path} could not be parsed (unexpected line structure); {VALID_INPUT}")

    def fail(row: int, what: str) -> None:
        raise UsageError(f"--data-path {path} line {line_of_row[row]}: {what}")

    def shown(column: str, row: int) -> str:
        value = frame[column].iloc[row]
        return repr(value) if isinstance(value, str) else repr(value.item() if hasattr(value, "item") else value)

    for column in ["user", "item", "timestamp"]:
        if frame[column].dtype.kind not in "iuf":
            frame[column] = frame[column].astype(str).str.strip()
            missing = np.flatnonzero((frame[column] == "").to_numpy())
            if len(missing):
                fail(missing[0], f"no {column} value; every line needs user, item, rating and timestamp")
    timestamps = _to_numbers(frame["timestamp"])
    bad = np.flatnonzero(~np.isfinite(timestamps.to_numpy(dtype=np.float64)))
    if len(bad):
        fail(bad[0], f"timestamp {shown('timestamp', bad[0])} is not a number; timestamps are unix seconds")
    if timestamps.dtype.kind != "i":
        timestamps = timestamps.round()
    for column in ["user", "item"]:
        numbers = _to_numbers(frame[column])
        if kind != "inter":  # u.data and ratings.dat ids are integers; .inter tokens may be any text
            bad = np.flatnonzero((numbers.isna() | (numbers != numbers.round())).to_numpy())
            if len(bad):
                fail(bad[0], f"{column} id {shown(column, bad[0])} is not an integer; {name} files hold integer "
                             "user and item ids")
        negative = np.flatnonzero((numbers < 0).fillna(False).to_numpy())
        if len(negative):
            fail(negative[0], f"{column} id {shown(column, negative[0])} is negative; ids are non-negative integers")
    ratings = pd.DataFrame(
        {"user": _as_ids(frame["user"]), "item": _as_ids(frame["item"]), "timestamp": timestamps.astype(np.int64)}
    )
    _check_enough(path, ratings)
    return ratings


def _to_numbers(column: pd.Series) -> pd.Series:
    """int64 or float64 values of a column (NaN where a value is not a number); fast for clean text columns."""
    if column.dtype.kind in "iuf":
        return column
    for dtype in (np.int64, np.float64):
        try:
            return column.astype(dtype)
        except (ValueError, TypeError, OverflowError):
            pass
    return pd.to_numeric(column, errors="coerce")


def _check_enough(path: Path, ratings: pd.DataFrame) -> None:
    """Leave-one-out needs a user with 3+ ratings (validation and test take the last two) and something to
    train on: a user with 4+ ratings, or one with exactly 2 (users with fewer than 3 train on all of theirs)."""
    per_user = ratings.groupby("user").size()
    users = f"{len(per_user)} user{'s' if len(per_user) != 1 else ''}"
    held = f"--data-path {path} holds {len(ratings)} rating{'s' if len(ratings) != 1 else ''} of {users}"
    if not (per_user >= 3).any():
        raise UsageError(
            f"{held}, at most {per_user.max()} per user: validation and test need a user with 3 or more ratings "
            "(they take the last two); give a larger ratings file"
        )
    if not ((per_user >= 4) | (per_user == 2)).any():
        raise UsageError(
            f"{held}, none with 4 or more: once validation and test take each user's last two ratings, nothing "
            "is left to train on; give a larger ratings file"
        )


def _as_ids(column: pd.Series) -> pd.Series:
    """Numeric ids as integers (so "7" in a .inter file and 7 in u.data sort alike), anything else as text."""
    if column.dtype.kind in "iu":
        return column.astype(np.int64)
    numbers = _to_numbers(column)
    if numbers.notna().all() and (numbers == numbers.round()).all():
        return numbers.astype(np.int64)
    return column.astype(str)


def _build_sequences(ratings: pd.DataFrame) -> tuple[datasets.Dataset, dict]:
    """Users -> 0..U-1 and items -> 1..I (both in sorted original-id order); per-user rows sorted by
    timestamp, ties in file order."""
    user_codes, user_ids = pd.factorize(ratings["user"], sort=True)
    item_codes, item_ids = pd.factorize(ratings["item"], sort=True)
    timestamps = ratings["timestamp"].to_numpy(dtype=np.int64)
    order = np.lexsort((np.arange(len(ratings)), timestamps, user_codes))  # last key is the primary one
    users, items, times = user_codes[order], item_codes[order] + 1, timestamps[order]
    num_users = len(user_ids)
    offsets = pa.array(np.concatenate([[0], np.cumsum(np.bincount(users, minlength=num_users))]), pa.int32())
    ds = datasets.Dataset.from_dict(
        {
            "user": pa.array(np.arange(num_users, dtype=np.int64)),
            "items": pa.ListArray.from_arrays(offsets, pa.array(items.astype(np.int64))),
            "timestamps": pa.ListArray.from_arrays(offsets, pa.array(times)),
        }
    )
    meta = {"num_users": num_users, "num_items": len(item_ids), "num_interactions": len(ratings)}
    return ds, meta


# ----------------------------------------------------------------------------------------------------
# prepare_movielens: raw file -> cached `datasets` dataset
# ----------------------------------------------------------------------------------------------------


def _cache_key(path: Path) -> str:
    """The processed build's key: the raw file's content and FORMAT_VERSION."""
    return file_fingerprint(path, FORMAT_VERSION)


def most_touched(ds: datasets.Dataset) -> int:
    """The most distinct items one user interacted with (what leaves that user the fewest untouched items)."""
    items = ds.with_format("arrow")[:].column("items")
    lengths = pc.list_value_length(items).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(items).to_numpy(zero_copy_only=False).astype(np.int64)
    if not len(flat):
        return 0
    owner = np.repeat(np.arange(len(lengths)), lengths)
    distinct = np.unique(owner * (flat.max() + 1) + flat) // (flat.max() + 1)  # the owner of each distinct pair
    return int(np.bincount(distinct).max())


def prepare_movielens(
    dataset: Literal["ml-100k", "ml-1m"], data_path: Path | None, cache_dir: Path,
    check: Callable[[datasets.Dataset, dict], None] | None = None,
) -> Prepared:
    """Per-user chronological sequences, built once and cached with `datasets` (save_to_disk/load_from_disk).

    Returns (ds, meta): ds columns user (int 0..U-1), items (list[int] remapped to 1..I, sorted by timestamp,
    ties keep file order (stable sort)), timestamps (list[int], unix seconds); meta = {num_users, num_items,
    num_interactions, source (str: where the raw file came from), dataset}.
    Users and items are numbered in the sorted order of their original ids.
    check(ds, meta): the caller's checks of a new build (raise UsageError), run before it is cached, so a refusal
    leaves no cache behind (a build found in the cache is the caller's to check).
    """
    datasets.disable_progress_bars()
    if dataset not in DATASETS:
        raise UsageError(f"--dataset {dataset} is unknown; use one of {', '.join(DATASETS)}")
    cache_dir = Path(cache_dir).expanduser()
    if data_path is not None:
        raw = _resolve_data_path(data_path)
        source = str(raw)
    elif dataset == "ml-100k":
        with writable(cache_dir):
            raw, source = _ml100k_raw(cache_dir)
    else:
        raise UsageError(
            f"--dataset {dataset} is not fetched automatically and --data-path is missing; download "
            f"{GROUPLENS_1M}, unzip it and pass --data-path .../ml-1m/ratings.dat"
        )

    def build() -> tuple[datasets.Dataset, dict]:
        ds, meta = _build_sequences(_read_ratings(raw))
        meta = {**meta, "source": source, "dataset": dataset}
        if check is not None:
            check(ds, meta)
        return ds, meta

    key = _cache_key(raw)
    ds, meta = cached_dataset(cache_dir, dataset, key, build)
    # source: the same file may have been built from another path; fingerprint: the cache key (the raw file's hash)
    meta.update(source=source, dataset=dataset, fingerprint=f"{dataset}-{key}")
    return Prepared(ds, meta)


# ----------------------------------------------------------------------------------------------------
# Leave-one-out split (SASRec protocol) with TiSASRec's per-user scaled times
# ----------------------------------------------------------------------------------------------------


@dataclass
class LeaveOneOut:
    """Padded [U, L] tensors (0 = padding, left-padded, the most recent maxlen positions), all on CPU.

    Users with fewer than 3 interactions train on all of them and have valid/test targets 0; eval_users
    lists the others. touched[u, i]: user u interacted with item i anywhere (train, valid or test); column 0
    is False. train_touched[u, i]: item i is in u's training part (what training negatives avoid, as in the
    original SASRec code: the held-out valid/test items may be drawn as training negatives).
    """

    num_users: int
    num_items: int
    maxlen: int
    train_input: torch.Tensor
    train_target: torch.Tensor
    train_time: torch.Tensor
    valid_input: torch.Tensor
    valid_time: torch.Tensor
    valid_target: torch.Tensor
    test_input: torch.Tensor
    test_time: torch.Tensor
    test_target: torch.Tensor
    touched: torch.Tensor
    train_touched: torch.Tensor
    eval_users: torch.Tensor


def _scaled_times(times: np.ndarray, owner: np.ndarray, num_users: int) -> np.ndarray:
    """TiSASRec: per user, round((t - t_min) / smallest non-zero gap between sorted timestamps) + 1."""
    if len(times) == 0:
        return times.astype(np.int64)
    order = np.lexsort((times, owner))
    sorted_times, sorted_owner = times[order], owner[order]
    gaps = np.diff(sorted_times)
    usable = (np.diff(sorted_owner) == 0) & (gaps != 0)
    scale = np.full(num_users, np.inf)
    np.minimum.at(scale, sorted_owner[1:][usable], gaps[usable].astype(np.float64))
    scale[~np.isfinite(scale)] = 1.0
    t_min = np.full(num_users, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(t_min, owner, times)
    # np.round rounds half to even, like Python's round() in TiSASRec's code.
    return np.round((times - t_min[owner]) / scale[owner]).astype(np.int64) + 1


def _concatenated_ranges(begin: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """np.concatenate([np.arange(b, b + k) for b, k in zip(begin, lengths)]), without the Python loop."""
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(begin, lengths) + within


def _right_aligned(values: np.ndarray, begin: np.ndarray, end: np.ndarray, maxlen: int) -> torch.Tensor:
    """Row u = values[begin[u]:end[u]], keeping the last maxlen, left-padded with 0 to maxlen."""
    begin = np.maximum(begin, end - maxlen)
    lengths = np.maximum(end - begin, 0)
    rows = np.repeat(np.arange(len(begin)), lengths)
    columns = maxlen - np.repeat(lengths, lengths) + _concatenated_ranges(np.zeros_like(begin), lengths)
    out = np.zeros((len(begin), maxlen), dtype=np.int64)
    out[rows, columns] = values[_concatenated_ranges(begin, lengths)]
    return torch.from_numpy(out)


def leave_one_out(ds: datasets.Dataset, meta: dict, maxlen: int) -> LeaveOneOut:
    """Split each user's chronological sequence s (n items): train s[:-2], valid target s[-2], test s[-1].

    train_input/target: train[:-1] -> train[1:] (every position predicts the next item); valid_input: train;
    test_input: train + [valid item]; *_time: the TiSASRec times of the *_input items. Users with n < 3 keep
    all n items for training (their valid/test inputs are those items, targets 0) and are not in eval_users.
    """
    if maxlen < 1:
        raise ValueError(f"maxlen must be >= 1, got {maxlen}")
    num_users, num_items = int(meta["num_users"]), int(meta["num_items"])
    table = ds.with_format("arrow")[:]
    users = table.column("user").to_numpy().astype(np.int64)
    item_lists, time_lists = table.column("items"), table.column("timestamps")
    lengths = pc.list_value_length(item_lists).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(users) and (users.min() < 0 or users.max() >= num_users or len(np.unique(users)) != len(users)):
        raise ValueError(f"user ids must be distinct and in 0..{num_users - 1}")
    # Flat arrays in user order (rows may come in any order).
    row_begin = np.cumsum(lengths) - lengths
    row_order = np.argsort(users, kind="stable")
    gather = _concatenated_ranges(row_begin[row_order], lengths[row_order])
    items = pc.list_flatten(item_lists).to_numpy(zero_copy_only=False).astype(np.int64)[gather]
    times = pc.list_flatten(time_lists).to_numpy(zero_copy_only=False).astype(np.int64)[gather]
    if len(items) and (items.min() < 1 or items.max() > num_items):
        raise ValueError(f"item ids must be in 1..{num_items}")

    n = np.zeros(num_users, dtype=np.int64)
    n[users] = lengths
    start = np.cumsum(n) - n
    owner = np.repeat(np.arange(num_users), n)
    scaled = _scaled_times(times, owner, num_users)

    evaluated = n >= 3
    train_len = np.where(evaluated, n - 2, n)
    train_end = start + train_len
    history_end = train_end + evaluated  # train + the validation item
    valid_target, test_target = np.zeros(num_users, dtype=np.int64), np.zeros(num_users, dtype=np.int64)
    valid_target[evaluated] = items[(start + n - 2)[evaluated]]
    test_target[evaluated] = items[(start + n - 1)[evaluated]]
    touched = torch.zeros(num_users, num_items + 1, dtype=torch.bool)
    touched[torch.from_numpy(owner), torch.from_numpy(items)] = True
    in_training = np.arange(len(items)) < np.repeat(train_end, n)  # each user's first train_len items
    train_touched = torch.zeros(num_users, num_items + 1, dtype=torch.bool)
    train_touched[torch.from_numpy(owner[in_training]), torch.from_numpy(items[in_training])] = True
    return LeaveOneOut(
        num_users=num_users,
        num_items=num_items,
        maxlen=maxlen,
        train_input=_right_aligned(items, start, np.maximum(train_end - 1, start), maxlen),
        train_target=_right_aligned(items, np.minimum(start + 1, train_end), train_end, maxlen),
        train_time=_right_aligned(scaled, start, np.maximum(train_end - 1, start), maxlen),
        valid_input=_right_aligned(items, start, train_end, maxlen),
        valid_time=_right_aligned(scaled, start, train_end, maxlen),
        valid_target=torch.from_numpy(valid_target),
        test_input=_right_aligned(items, start, history_end, maxlen),
        test_time=_right_aligned(scaled, start, history_end, maxlen),
        test_target=torch.from_numpy(test_target),
        touched=touched,
        train_touched=train_touched,
        eval_users=torch.from_numpy(np.flatnonzero(evaluated).astype(np.int64)),
    )


# ----------------------------------------------------------------------------------------------------
# torch Dataset over per-user rows
# ----------------------------------------------------------------------------------------------------


class UserSequences(TensorRows):
    """TensorRows indexed by user: item i is {"user": users[i], **{k: v[users[i]]}} (users: every row when None).

    Every value is a tensor, so the default collate stacks them into a batch.
    """

    def __init__(self, fields: dict[str, torch.Tensor], users: torch.Tensor | None = None):
        super().__init__(fields, rows=users, index_name="user")

    @property
    def users(self) -> torch.Tensor:
        return self.rows
