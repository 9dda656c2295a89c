"""Sudoku data for HRM: a generator of unique-solution puzzles rated by this module's solver, the augmentations
that keep a grid valid, a reader of the public Sudoku-Extreme CSVs, and the `datasets` (Arrow) store.

    python -m toolkit.data.sudoku build --out data/sudoku-gen-1k-aug-1000 --train-puzzles 1000 --aug 1000 \
        --min-rating 20
    python -m toolkit.data.sudoku build --from-csv path/to/sudoku-extreme/ --out data/sudoku-extreme-1k-aug-1000 \
        --full-test

A grid is 81 cells in row-major order, 0 for a blank and 1..9 for a digit. The rating of a puzzle is the number
of dead ends (backtracks) `solve` meets before its first solution, choosing the cell with the fewest candidates
and trying digits in ascending order (0: naked singles solve it). Uniqueness is checked by searching for a
second solution.

Sudoku-Extreme CSVs are used with every rating (--min-rating applies to generated puzzles only), as the paper does;
--full-test makes every puzzle of test.csv a test puzzle (the paper's test set) instead of --test-puzzles of them.

A built dataset is a directory holding dataset/ (`datasets` save_to_disk, loaded memory-mapped) and meta.json.
Its rows are the training rows (each original puzzle followed by its augmentations; the original is aug 0), then
the validation and the test puzzles (never augmented), each a contiguous range named in meta["splits"]. Columns:
id (the row number), question, answer (int8[81]), puzzle (the original puzzle's number; validation and test
puzzles are other originals than the training ones, so no augmentation of a held-out puzzle is ever trained on),
aug (0 = the original), rating.

Errors (one line, exit 2, naming the file and line): a CSV row whose question is not 81 characters of 1-9 or '.'
(or '0'), or has no blank (a puzzle with nothing to solve is refused everywhere, in a CSV and in a built dataset, so
blank-cell accuracy is never 0/0), whose answer is not a valid solved grid that agrees with the question's givens,
a rating that is not ASCII digits 0-9 up to 2^31 - 1 (not '²', not Arabic-Indic digits, not 5,000 digits), a
missing column; a --data directory that is not a built dataset.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from toolkit.data.cache import DATASET_DIR, META_FILE, cached_dataset, file_fingerprint, save_atomically, writable
from toolkit.data.prepared import Prepared, require_path
from toolkit.errors import UsageError
from toolkit.process.entry import one_line_errors

FORMAT_VERSION = 1
CELLS = 81
ALL_DIGITS = 0x3FE  # bits 1..9
_ROW = [i // 9 for i in range(CELLS)]
_COL = [i % 9 for i in range(CELLS)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(CELLS)]
_DIGITS_OF = {mask: [d for d in range(1, 10) if mask >> d & 1] for mask in range(1 << 10) if not mask & 1}


# ----------------------------------------------------------------------------------------------------
# Solver: depth-first search on the cell with the fewest candidates (bitmasks)
# ----------------------------------------------------------------------------------------------------


@dataclass
class Solved:
    solutions: list[list[int]]  # up to `limit` solutions, in search order
    backtracks: int  # dead ends met before the first solution: the rating


def solve(grid, limit: int = 2, rng: random.Random | None = None) -> Solved:
    """Search for up to `limit` solutions of `grid` (81 ints, 0 = blank). rng: try digits in a random order
    (the generator fills an empty grid this way) instead of ascending. A grid whose givens clash has none."""
    cells = [int(v) for v in grid]
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(cells):
        if v:
            bit = 1 << v
            if (rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]]) & bit:
                return Solved([], 0)
            rows[_ROW[i]] |= bit
            cols[_COL[i]] |= bit
            boxes[_BOX[i]] |= bit
    empty = [i for i, v in enumerate(cells) if v == 0]
    found: list[list[int]] = []
    backtracks = 0
    first_backtracks = [None]

    def search() -> bool:  # True: stop (enough solutions)
        nonlocal backtracks
        best, best_mask, best_count = -1, 0, 10
        for i in empty:
            if cells[i] == 0:
                mask = ALL_DIGITS & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
                count = len(_DIGITS_OF[mask])
                if count < best_count:
                    best, best_mask, best_count = i, mask, count
                    if count <= 1:
                        break
        if best < 0:
            found.append(list(cells))
            if first_backtracks[0] is None:
                first_backtracks[0] = backtracks
            return len(found) >= limit
        if best_count == 0:
            backtracks += 1
            return False
        r, c, b = _ROW[best], _COL[best], _BOX[best]
        digits = _DIGITS_OF[best_mask]
        if rng is not None:
            digits = rng.sample(digits, len(digits))
        for d in digits:
            bit = 1 << d
            cells[best] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            if search():
                return True
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        cells[best] = 0
        backtracks += 1
        return False

    search()
    return Solved(found, first_backtracks[0] if first_backtracks[0] is not None else backtracks)


def is_valid_solution(answer) -> bool:
    """Every row, column and box holds 1..9 exactly once."""
    grid = np.asarray(answer).reshape(9, 9)
    full = set(range(1, 10))
    boxes = grid.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
    return all(set(line.tolist()) == full for part in (grid, grid.T, boxes) for line in part)


def agrees(question, answer) -> bool:
    """The answer keeps every given of the question."""
    question, answer = np.asarray(question), np.asarray(answer)
    return bool(np.all((question == 0) | (question == answer)))


# ----------------------------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------------------------


def generate_puzzle(rng: random.Random, max_blanks: int = CELLS, min_rating: int = 0,
                    max_tries: int = 10_000) -> tuple[list[int], list[int], int]:
    """(question, answer, rating): a random solved grid with cells blanked in random order while the puzzle keeps
    exactly one solution, until max_blanks are blank or no further cell can go; retried until rating >= min_rating.
    """
    for _ in range(max_tries):
        answer = solve([0] * CELLS, limit=1, rng=rng).solutions[0]
        question = list(answer)
        blanks = 0
        for cell in rng.sample(range(CELLS), CELLS):
            if blanks >= max_blanks:
                break
            question[cell] = 0
            if len(solve(question, limit=2).solutions) == 1:
                blanks += 1
            else:
                question[cell] = answer[cell]
        rating = solve(question, limit=1).backtracks
        if rating >= min_rating:
            return question, answer, rating
    raise UsageError(f"--min-rating {min_rating}: no puzzle that hard in {max_tries} tries with --max-blanks "
                     f"{max_blanks}; lower --min-rating or raise --max-blanks")


# ----------------------------------------------------------------------------------------------------
# Augmentations that keep a grid valid, applied identically to puzzle and solution
# ----------------------------------------------------------------------------------------------------


def random_transform(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(digit_map [10], cell_order [81]): relabel digits (0, the blank, stays 0), optionally transpose, permute
    the bands and the rows within each band, the stacks and the columns within each stack."""
    digit_map = np.concatenate([[0], rng.permutation(9) + 1])
    bands = rng.permutation(3)
    rows = np.concatenate([band * 3 + rng.permutation(3) for band in bands])
    stacks = rng.permutation(3)
    cols = np.concatenate([stack * 3 + rng.permutation(3) for stack in stacks])
    order = np.arange(CELLS).reshape(9, 9)
    if rng.random() < 0.5:
        order = order.T
    return digit_map, order[rows][:, cols].reshape(CELLS)


def apply_transform(grid: np.ndarray, transform: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    digit_map, cell_order = transform
    return digit_map[np.asarray(grid)[..., cell_order]].astype(np.int8)


# ----------------------------------------------------------------------------------------------------
# Building a dataset
# ----------------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """What a generated dataset is made of (also its cache key)."""

    train_puzzles: int = 1000
    aug: int = 1000
    val_puzzles: int = 100
    test_puzzles: int = 1000
    min_rating: int = 0
    max_blanks: int = CELLS
    seed: int = 0

    def check(self) -> None:
        for name in ("train_puzzles", "val_puzzles", "test_puzzles"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid; it must be >= 1")
        if self.aug < 0 or self.min_rating < 0:
            bad = "--aug" if self.aug < 0 else "--min-rating"
            raise UsageError(f"{bad} {self.aug if self.aug < 0 else self.min_rating} is invalid; it must be >= 0")
        if not 1 <= self.max_blanks <= CELLS:
            raise UsageError(f"--max-blanks {self.max_blanks} is invalid; give 1 .. {CELLS}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed {self.seed} is invalid; give an integer in 0 .. {2**32 - 1}")

    @property
    def key(self) -> str:
        text = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def _rows(puzzles: list[tuple], aug: int, rng: np.random.Generator, first_puzzle: int) -> dict[str, np.ndarray]:
    """Each puzzle (question, answer, rating) followed by `aug` augmented copies of it."""
    copies = 1 + aug
    questions = np.zeros((len(puzzles) * copies, CELLS), dtype=np.int8)
    answers = np.zeros_like(questions)
    for p, (question, answer, _) in enumerate(puzzles):
        question, answer = np.asarray(question, dtype=np.int8), np.asarray(answer, dtype=np.int8)
        questions[p * copies], answers[p * copies] = question, answer
        for a in range(1, copies):
            transform = random_transform(rng)
            questions[p * copies + a] = apply_transform(question, transform)
            answers[p * copies + a] = apply_transform(answer, transform)
    return {
        "question": questions,
        "answer": answers,
        "puzzle": np.repeat(np.arange(first_puzzle, first_puzzle + len(puzzles), dtype=np.int32), copies),
        "aug": np.tile(np.arange(copies, dtype=np.int32), len(puzzles)),
        "rating": np.repeat(np.asarray([r for _, _, r in puzzles], dtype=np.int32), copies),
    }


FEATURES = datasets.Features({
    "id": datasets.Value("int64"),
    "question": datasets.Sequence(datasets.Value("int8"), length=CELLS),
    "answer": datasets.Sequence(datasets.Value("int8"), length=CELLS),
    "puzzle": datasets.Value("int32"),
    "aug": datasets.Value("int32"),
    "rating": datasets.Value("int32"),
})


def assemble(train: list[tuple], val: list[tuple], test: list[tuple], aug: int, seed: int,
             **info) -> tuple[datasets.Dataset, dict]:
    """(dataset, meta) from original puzzles of each split: train augmented, val and test as they are."""
    rng = np.random.default_rng(seed)
    parts = [_rows(train, aug, rng, 0), _rows(val, 0, rng, len(train)), _rows(test, 0, rng, len(train) + len(val))]
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    total = len(columns["question"])
    columns["id"] = np.arange(total, dtype=np.int64)
    n_train, n_val = len(parts[0]["question"]), len(parts[1]["question"])
    table = {name: columns[name] for name in FEATURES}
    table["question"], table["answer"] = list(table["question"]), list(table["answer"])
    ds = datasets.Dataset.from_dict(table, features=FEATURES)
    content = hashlib.sha1(columns["question"].tobytes() + columns["answer"].tobytes()).hexdigest()[:16]
    meta = {
        "format": FORMAT_VERSION,
        "splits": {"train": [0, n_train], "val": [n_train, n_train + n_val], "test": [n_train + n_val, total]},
        "puzzles": {"train": len(train), "val": len(val), "test": len(test)},
        "aug": aug,
        "fingerprint": f"sudoku-{content}",
        **info,
    }
    return ds, meta


def generate(recipe: Recipe, progress: bool = True) -> tuple[datasets.Dataset, dict]:
    """A generated dataset: distinct original puzzles for train, val and test (by construction, then checked)."""
    from tqdm.auto import tqdm

    recipe.check()
    rng = random.Random(recipe.seed)
    wanted = recipe.train_puzzles + recipe.val_puzzles + recipe.test_puzzles
    puzzles, seen = [], set()
    with tqdm(total=wanted, desc="generating sudoku", unit="puzzle", **({} if progress else {"disable": True})) as bar:
        while len(puzzles) < wanted:
            question, answer, rating = generate_puzzle(rng, recipe.max_blanks, recipe.min_rating)
            if tuple(question) in seen:
                continue
            seen.add(tuple(question))
            puzzles.append((question, answer, rating))
            bar.update(1)
    train = puzzles[: recipe.train_puzzles]
    val = puzzles[recipe.train_puzzles: recipe.train_puzzles + recipe.val_puzzles]
    test = puzzles[recipe.train_puzzles + recipe.val_puzzles:]
    return assemble(train, val, test, recipe.aug, recipe.seed, source="generated", recipe=asdict(recipe))


# ----------------------------------------------------------------------------------------------------
# The public Sudoku-Extreme CSVs (source, question, answer, rating)
# ----------------------------------------------------------------------------------------------------

CSV_COLUMNS = ("source", "question", "answer", "rating")
MAX_RATING = 2**31 - 1  # stored as int32


def _grid(text: str, path: Path, line: int, column: str, blanks: bool) -> list[int]:
    allowed = "123456789" + (".0" if blanks else "")
    if len(text) != CELLS:
        raise UsageError(f"{path} line {line}: {column} has {len(text)} characters; a Sudoku-Extreme {column} is "
                         f"{CELLS} characters of {'1-9 or . for a blank' if blanks else '1-9'}")
    bad = next((ch for ch in text if ch not in allowed), None)
    if bad is not None:
        raise UsageError(f"{path} line {line}: {column} holds {bad!r} at column {text.index(bad) + 1}; only "
                         f"{'1-9 and . (blank)' if blanks else '1-9'} are allowed")
    grid = [0 if ch in ".0" else int(ch) for ch in text]
    if blanks and 0 not in grid:
        raise UsageError(f"{path} line {line}: the question has no blank ('.' or '0'): nothing to solve, and its "
                         "blank-cell accuracy would be 0/0; every puzzle needs at least one blank")
    return grid


def _rating(text: str, path: Path, line: int) -> int:
    """A rating: ASCII digits 0-9 only (str.isdigit also takes '²' and Arabic-Indic digits), at most MAX_RATING."""
    if not (text and len(text) <= len(str(MAX_RATING)) and all("0" <= ch <= "9" for ch in text)) \
            or int(text) > MAX_RATING:
        shown = repr(text) if len(text) <= 20 else f"{text[:12]!r}... ({len(text)} characters)"
        raise UsageError(f"{path} line {line}: rating {shown} is not a non-negative integer of ASCII digits 0-9 "
                         f"up to {MAX_RATING}")
    return int(text)


def read_csv(path: Path | str) -> list[tuple[list[int], list[int], int]]:
    """[(question, answer, rating)] of a Sudoku-Extreme CSV, every row checked (errors name the file and line)."""
    path = Path(path)
    try:
        handle = open(path, newline="", encoding="utf-8-sig")  # a byte-order mark (Excel's UTF-8 CSV) is fine
    except OSError as error:
        raise UsageError(f"{path} cannot be read ({error.strerror}); give a Sudoku-Extreme CSV") from None
    puzzles = []
    with handle:
        try:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None or [h.strip() for h in header] != list(CSV_COLUMNS):
                raise UsageError(f"{path} line 1: the header is {header!r}; a Sudoku-Extreme CSV has the columns "
                                 f"{','.join(CSV_COLUMNS)}")
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                nul = next((CSV_COLUMNS[i] if i < len(CSV_COLUMNS) else f"field {i + 1}"
                            for i, field in enumerate(row) if "\x00" in field), None)
                if nul is not None:
                    raise UsageError(f"{path} line {line}: {nul} holds a NUL byte; the file is damaged (a text CSV "
                                     "has none)")
                if len(row) != len(CSV_COLUMNS):
                    raise UsageError(f"{path} line {line}: {len(row)} fields; expected {len(CSV_COLUMNS)} "
                                     f"({','.join(CSV_COLUMNS)})")
                question = _grid(row[1].strip(), path, line, "question", blanks=True)
                answer = _grid(row[2].strip(), path, line, "answer", blanks=False)
                if not is_valid_solution(answer):
                    raise UsageError(f"{path} line {line}: the answer is not a valid Sudoku solution (a digit repeats "
                                     "in a row, column or box)")
                if not agrees(question, answer):
                    raise UsageError(f"{path} line {line}: the answer changes a given digit of the question")
                puzzles.append((question, answer, _rating(row[3].strip(), path, line)))
        except UnicodeDecodeError:
            raise UsageError(f"{path} is not a text CSV (not UTF-8); give a Sudoku-Extreme CSV") from None
        except csv.Error as error:
            raise UsageError(f"{path} line {reader.line_num}: {error}") from None
    if not puzzles:
        raise UsageError(f"{path} holds no puzzles; give a Sudoku-Extreme CSV with rows after the header")
    return puzzles


def csv_files(directory: Path | str) -> tuple[Path, Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--from-csv {directory} is not a directory; give the folder holding the Sudoku-Extreme "
                         "train.csv and test.csv")
    train, test = directory / "train.csv", directory / "test.csv"
    for path in (train, test):
        if not path.is_file():
            raise UsageError(f"{directory} has no {path.name}; the Sudoku-Extreme folder holds train.csv and test.csv")
    return train, test


def csv_recipe(recipe: Recipe) -> Recipe:
    """The recipe as it applies to CSV data: the generator's settings (min_rating, max_blanks) do not, so they do
    not enter the cache key either. The paper uses Sudoku-Extreme as it is, without a rating filter."""
    return dataclasses.replace(recipe, min_rating=0, max_blanks=CELLS)


def from_csv(directory: Path | str, recipe: Recipe, full_test: bool = False) -> tuple[datasets.Dataset, dict]:
    """Train puzzles sampled from train.csv (every rating), val puzzles from the rest of train.csv, test puzzles
    sampled from test.csv (all of them with full_test, or when test_puzzles exceeds its size), as the HRM paper
    does (it tests on the whole test.csv)."""
    recipe = csv_recipe(recipe)
    recipe.check()
    train_path, test_path = csv_files(directory)
    rng = random.Random(recipe.seed)
    pool = read_csv(train_path)
    test_pool = read_csv(test_path)
    if len(pool) < recipe.train_puzzles + recipe.val_puzzles:
        raise UsageError(f"{train_path} has {len(pool)} puzzles; --train-puzzles {recipe.train_puzzles} + "
                         f"--val-puzzles {recipe.val_puzzles} is more: ask for fewer")
    chosen = rng.sample(range(len(pool)), recipe.train_puzzles + recipe.val_puzzles)
    train = [pool[i] for i in chosen[: recipe.train_puzzles]]
    val = [pool[i] for i in chosen[recipe.train_puzzles:]]
    tested = len(test_pool) if full_test else min(recipe.test_puzzles, len(test_pool))
    test_rows = sorted(rng.sample(range(len(test_pool)), tested))
    test = [test_pool[i] for i in test_rows]
    ds, meta = assemble(train, val, test, recipe.aug, recipe.seed, source=f"csv:{Path(directory).resolve()}",
                        recipe=asdict(recipe), full_test=full_test)
    check_dataset(ds, meta, f"--data {directory}")  # e.g. a puzzle in train.csv and test.csv, or twice in one
    return ds, meta


def csv_key(directory: Path | str, recipe: Recipe, full_test: bool = False) -> str:
    train, test = csv_files(directory)
    text = (f"{csv_recipe(recipe).key}:{file_fingerprint(train, FORMAT_VERSION)}:"
            f"{file_fingerprint(test, FORMAT_VERSION)}{':full-test' if full_test else ''}")
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


VALID_DATA = ("build one with `python -m toolkit.data.sudoku build --out DIR ...`, or give a folder holding the "
              "Sudoku-Extreme train.csv and test.csv")


def load_built(directory: Path | str, flag: str = "--data") -> Prepared:
    """(dataset memory-mapped from disk, meta) of a directory written by `build`."""
    require_path(directory, flag, VALID_DATA)
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise UsageError(f"{flag} {directory} is a file; give a dataset directory built by "
                         "`python -m toolkit.data.sudoku build` (it holds meta.json and dataset/)")
    meta_path = directory / META_FILE
    if not meta_path.is_file() or not (directory / DATASET_DIR).is_dir():
        raise UsageError(f"{flag} {directory} is not a Sudoku dataset (no {META_FILE} and {DATASET_DIR}/); build one "
                         "with `python -m toolkit.data.sudoku build --out DIR` or give a folder holding the "
                         "Sudoku-Extreme train.csv and test.csv")
    try:
        meta = json.loads(meta_path.read_text())
        splits = meta["splits"]
        ds = datasets.load_from_disk(str(directory / DATASET_DIR))
    except (ValueError, KeyError, OSError, FileNotFoundError) as error:
        raise UsageError(f"{flag} {directory}: {META_FILE} or {DATASET_DIR}/ cannot be read ({error}); build it "
                         "again") from None
    if meta.get("format") != FORMAT_VERSION or set(splits) != {"train", "val", "test"}:
        raise UsageError(f"{flag} {directory} was built by another version of toolkit.data.sudoku (format "
                         f"{meta.get('format')}, expected {FORMAT_VERSION}); build it again")
    check_dataset(ds, meta, f"{flag} {directory}")
    return Prepared(ds, meta)


UNIQUE_CHECKS = 5000  # originals whose single solution check_dataset confirms with the solver
MIN_GIVENS = 17  # no Sudoku with fewer givens has a single solution (McGuire, Tugemann and Civario 2012)


def check_dataset(ds: datasets.Dataset, meta: dict, where: str) -> None:
    """What a built dataset (edited, or built by hand) can get wrong, each one line: splits that are not the three
    consecutive parts of the table, row counts that do not match the puzzles and augmentations recorded, a puzzle
    twice (in one split or across splits: a test puzzle seen in training), a puzzle that cannot have one solution
    (fewer than 17 givens), a puzzle with no blank (nothing to solve: blank-cell accuracy would be 0/0), and an answer
    that does not solve its puzzle."""
    rows = len(ds)
    try:
        bounds = [tuple(int(v) for v in meta["splits"][name]) for name in ("train", "val", "test")]
        aug, puzzles = int(meta["aug"]), {name: int(meta["puzzles"][name]) for name in ("train", "val", "test")}
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where}: meta.json's splits, aug or puzzles are not numbers; build it again") from None
    expected_starts = [0, bounds[0][1], bounds[1][1]]
    if any(len(b) != 2 for b in bounds) or [b[0] for b in bounds] != expected_starts or bounds[2][1] != rows or \
            any(start > stop for start, stop in bounds):
        raise UsageError(f"{where}: meta.json's splits {meta['splits']} are not three consecutive parts of the "
                         f"{rows} rows (train from row 0, then val, then test to the end); build it again")
    counts = {"train": puzzles["train"] * (1 + aug), "val": puzzles["val"], "test": puzzles["test"]}
    for (name, count), (start, stop) in zip(counts.items(), bounds, strict=True):
        if stop - start != count:
            raise UsageError(f"{where}: the {name} split holds {stop - start} rows, but meta.json records "
                             f"{puzzles[name]} puzzles x {1 + aug if name == 'train' else 1} (aug {aug}); build it "
                             "again")
    originals = [*range(0, bounds[0][1], 1 + aug), *range(bounds[1][0], rows)]
    table = ds.select(originals).with_format("numpy")
    questions, answers = np.stack(table["question"]), np.stack(table["answer"])
    split_of = np.repeat(["train", "val", "test"], [puzzles["train"], puzzles["val"], puzzles["test"]])
    seen: dict[bytes, int] = {}
    for i, question in enumerate(questions):
        key = question.tobytes()
        if key in seen:
            first = seen[key]
            where_first = f"{split_of[first]} puzzle {first}"
            raise UsageError(f"{where}: {split_of[i]} puzzle {i} repeats {where_first}"
                             + (" (a test puzzle seen in training)" if split_of[first] != split_of[i] else "")
                             + "; every puzzle must be in one split, once")
        seen[key] = i
    givens = (questions > 0).sum(axis=1)
    few = np.flatnonzero(givens < MIN_GIVENS)
    if len(few):
        raise UsageError(f"{where}: {split_of[few[0]]} puzzle {few[0]} has {givens[few[0]]} givens; with fewer than "
                         f"{MIN_GIVENS} a Sudoku has more than one solution")
    full = np.flatnonzero(givens == CELLS)
    if len(full):
        raise UsageError(f"{where}: {split_of[full[0]]} puzzle {full[0]} has no blank cell: nothing to solve, and its "
                         "blank-cell accuracy would be 0/0; every puzzle needs at least one blank")
    for i, (question, answer) in enumerate(zip(questions, answers, strict=True)):
        if not (is_valid_solution(answer) and agrees(question, answer)):
            raise UsageError(f"{where}: the answer of {split_of[i]} puzzle {i} does not solve it")
    # One solution each: the solver stops at a second one (about 2 ms a hard puzzle); a table of more originals than
    # UNIQUE_CHECKS is checked at evenly spaced ones, so a load stays seconds long.
    step = max(1, -(-len(questions) // UNIQUE_CHECKS))
    for i in range(0, len(questions), step):
        if len(solve(questions[i].tolist(), limit=2).solutions) > 1:
            raise UsageError(f"{where}: {split_of[i]} puzzle {i} has more than one solution; a Sudoku has exactly one")


def is_csv_folder(data: Path) -> bool:
    """A folder of Sudoku-Extreme CSVs (not a built dataset)."""
    return data.is_dir() and (data / "train.csv").exists() and not (data / META_FILE).exists()


def load_sudoku(data: Path | None, recipe: Recipe, cache_dir: Path, progress: bool = True,
                full_test: bool = False) -> Prepared:
    """Prepared (dataset, meta): a built directory (`build --out`), a folder of Sudoku-Extreme CSVs (converted once into
    cache_dir; full_test: every puzzle of test.csv is a test puzzle), or, without `data`, the generated dataset of
    `recipe`, built once into cache_dir."""
    datasets.disable_progress_bars()
    if data is not None:
        data = Path(data).expanduser()
        if is_csv_folder(data):
            return cached_dataset(cache_dir, "sudoku-extreme", csv_key(data, recipe, full_test),
                                  lambda: from_csv(data, recipe, full_test))
        if full_test:
            raise UsageError(f"--full-test applies to a folder of Sudoku-Extreme CSVs; --data {data} is a built "
                             "dataset whose test split was fixed when it was built (build it with `python -m "
                             "toolkit.data.sudoku build --from-csv DIR --full-test`, or give the CSV folder)")
        return load_built(data)
    if full_test:
        raise UsageError("--full-test tests on every puzzle of the Sudoku-Extreme test.csv; give --data with the "
                         "folder holding train.csv and test.csv (generated puzzles have no test.csv)")
    recipe.check()
    return cached_dataset(cache_dir, "sudoku-generated", recipe.key, lambda: generate(recipe, progress))


def split(ds: datasets.Dataset, meta: dict, name: str) -> datasets.Dataset:
    """One split as a torch-formatted view of the memory-mapped table (a contiguous slice: no copy)."""
    start, stop = meta["splits"][name]
    return ds.select(range(start, stop)).with_format("torch")


def stored_columns(ds: datasets.Dataset) -> dict:
    """Every column of `ds` as one tensor in its stored dtype (int8 cells stay int8: 8x less than the torch
    format's int64), read from the Arrow table at once. For a split (a contiguous slice, no indices mapping)."""
    import torch  # here: the command line (build, inspect) does not need it

    if ds._indices is not None:
        raise ValueError("stored_columns reads a contiguous table; this dataset has an indices mapping")
    columns = {}
    for name in ds.column_names:
        column = ds.data.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(column.type):  # a grid: [rows, cells]
            values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
        else:
            values = column.to_numpy(zero_copy_only=False)
        columns[name] = torch.from_numpy(np.array(values))  # a writable copy, off the memory map
    return columns


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m toolkit.data.sudoku", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="generate (or convert Sudoku-Extreme CSVs) and store a dataset")
    defaults = Recipe()
    build.add_argument("--out", type=Path, required=True, help="directory to write (must not hold a dataset)")
    build.add_argument("--from-csv", type=Path, default=None, metavar="DIR",
                       help="convert the Sudoku-Extreme train.csv/test.csv in DIR instead of generating")
    build.add_argument("--train-puzzles", type=int, default=defaults.train_puzzles)
    build.add_argument("--aug", type=int, default=defaults.aug, help="augmented copies per training puzzle")
    build.add_argument("--val-puzzles", type=int, default=defaults.val_puzzles)
    build.add_argument("--test-puzzles", type=int, default=defaults.test_puzzles)
    build.add_argument("--min-rating", type=int, default=None,
                       help="generated puzzles only: keep those whose rating (solver backtracks) is at least this "
                            f"(default {defaults.min_rating}); CSV data is used unfiltered, as the paper does")
    build.add_argument("--full-test", action="store_true",
                       help="with --from-csv: every puzzle of test.csv is a test puzzle (the paper's test set)")
    build.add_argument("--max-blanks", type=int, default=defaults.max_blanks,
                       help="blank at most this many cells (81: as many as uniqueness allows; fewer: easier)")
    build.add_argument("--seed", type=int, default=defaults.seed)
    return parser


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        raise SystemExit(2 if exit_.code else 0) from None
    datasets.disable_progress_bars()
    if args.from_csv is not None and args.min_rating is not None:
        raise UsageError(f"--min-rating {args.min_rating} applies to generated puzzles; Sudoku-Extreme CSVs are used "
                         "with every rating, as the paper does: leave it out with --from-csv")
    if args.full_test and args.from_csv is None:
        raise UsageError("--full-test needs --from-csv DIR (the Sudoku-Extreme test.csv); generated puzzles have "
                         "no test.csv")
    min_rating = Recipe().min_rating if args.min_rating is None else args.min_rating
    recipe = Recipe(args.train_puzzles, args.aug, args.val_puzzles, args.test_puzzles, min_rating,
                    args.max_blanks, args.seed)
    recipe.check()
    out = args.out
    if (out / META_FILE).exists():
        raise UsageError(f"--out {out} already holds a dataset; choose another directory (nothing is overwritten)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    if args.from_csv is not None:
        csv_files(args.from_csv)
        ds, meta = from_csv(args.from_csv, recipe, args.full_test)
    else:
        ds, meta = generate(recipe)
    with writable(out, "--out"):
        save_atomically(ds, meta, out)
    print(f"wrote {out}: {json.dumps(meta['splits'])} rows ({meta['source']})", file=sys.stderr)
    return meta


if __name__ == "__main__":
    main()
