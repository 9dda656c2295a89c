"""Sudoku data: generated puzzles have exactly one solution, augmentations keep grids valid and consistent, the
split is by original puzzle, the Sudoku-Extreme CSV reader round-trips and names bad rows, the store is Arrow."""

import json
import random
import shutil
import subprocess
import sys

import datasets
import numpy as np
import pytest
from conftest import ROOT

from toolkit.data import sudoku
from toolkit.errors import UsageError

# A valid solved grid; puzzles are made from it by blanking cells.
SOLUTION = [int(c) for c in
            "534678912672195348198342567859761423426853791713924856961537284287419635345286179"]


def _small_recipe(**changes):
    values = dict(train_puzzles=6, aug=3, val_puzzles=2, test_puzzles=3, max_blanks=30, seed=5)
    return sudoku.Recipe(**{**values, **changes})


def test_solver_finds_the_unique_solution_and_counts_two_for_an_ambiguous_grid():
    puzzle = list(SOLUTION)
    for cell in range(0, 81, 10):  # the diagonal: one blank per row, column and box
        puzzle[cell] = 0
    solved = sudoku.solve(puzzle)
    assert solved.solutions == [SOLUTION]
    # an empty grid has many solutions: the search stops at the second
    assert len(sudoku.solve([0] * 81, limit=2).solutions) == 2
    # Clashing givens: no solution
    clash = [0] * 81
    clash[0] = clash[1] = 5
    assert sudoku.solve(clash).solutions == []


def test_generated_puzzles_are_unique_valid_and_respect_blanks_and_rating():
    rng = random.Random(1)
    for max_blanks in (10, 40, 81):
        question, answer, rating = sudoku.generate_puzzle(rng, max_blanks=max_blanks)
        assert sudoku.is_valid_solution(answer) and sudoku.agrees(question, answer)
        assert question.count(0) <= max_blanks
        solved = sudoku.solve(question, limit=2)
        assert solved.solutions == [answer]  # exactly one solution
        assert rating == solved.backtracks
    hard = sudoku.generate_puzzle(random.Random(2), max_blanks=81, min_rating=20)
    assert hard[2] >= 20 and sudoku.solve(hard[0]).backtracks >= 20


def test_augmentations_keep_every_grid_valid_and_consistent():
    rng = np.random.default_rng(0)
    question, answer, _ = sudoku.generate_puzzle(random.Random(0), max_blanks=50)
    question, answer = np.array(question, dtype=np.int8), np.array(answer, dtype=np.int8)
    seen = set()
    for _ in range(200):
        transform = sudoku.random_transform(rng)
        q, a = sudoku.apply_transform(question, transform), sudoku.apply_transform(answer, transform)
        assert sudoku.is_valid_solution(a)
        assert sudoku.agrees(q, a)
        assert (q == 0).sum() == (question == 0).sum()  # blanks stay blanks
        assert sudoku.solve(q.tolist(), limit=2).solutions == [a.tolist()]
        seen.add(a.tobytes())
    assert len(seen) > 190  # they really differ


def test_built_dataset_splits_by_original_puzzle_and_loads_from_arrow(tmp_path):
    ds, meta = sudoku.cached_dataset(tmp_path, "sudoku-generated", "k", lambda: sudoku.generate(_small_recipe(),
                                                                                                  progress=False))
    assert meta["splits"] == {"train": [0, 24], "val": [24, 26], "test": [26, 29]}
    assert ds.cache_files and ds.cache_files[0]["filename"].endswith(".arrow")  # memory-mapped from disk
    assert list(ds["id"]) == list(range(29))
    train, val, test = (sudoku.split(ds, meta, name) for name in ("train", "val", "test"))
    parts = {"train": train, "val": val, "test": test}
    puzzles = {name: {int(p) for p in part["puzzle"]} for name, part in parts.items()}
    assert not puzzles["train"] & puzzles["val"] and not puzzles["train"] & puzzles["test"]
    assert not puzzles["val"] & puzzles["test"]
    assert [int(a) for a in train["aug"]] == [0, 1, 2, 3] * 6 and {int(a) for a in test["aug"]} == {0}
    for row in range(len(ds)):
        q, a = np.array(ds[row]["question"]), np.array(ds[row]["answer"])
        assert sudoku.is_valid_solution(a) and sudoku.agrees(q, a)
    # the original of every training puzzle has exactly one solution, and so has each augmentation
    for row in range(0, 24, 5):
        q = list(ds[row]["question"])
        assert len(sudoku.solve(q, limit=2).solutions) == 1


def _write_csv(path, rows, header="source,question,answer,rating"):
    path.write_text(header + "\n" + "".join(f"{s},{q},{a},{r}\n" for s, q, a, r in rows))


def _csv_rows(count, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        question, answer, rating = sudoku.generate_puzzle(rng, max_blanks=30)
        rows.append((f"src{i}", "".join(str(v) if v else "." for v in question), "".join(map(str, answer)), rating))
    return rows


def test_csv_reader_round_trips_and_builds_the_paper_layout(tmp_path):
    rows = _csv_rows(12, 3)
    _write_csv(tmp_path / "train.csv", rows[:9])
    _write_csv(tmp_path / "test.csv", rows[9:])
    read = sudoku.read_csv(tmp_path / "train.csv")
    assert [("".join(str(v) if v else "." for v in q), "".join(map(str, a)), r) for q, a, r in read] == \
        [(q, a, r) for _, q, a, r in rows[:9]]
    ds, meta = sudoku.from_csv(tmp_path, sudoku.Recipe(train_puzzles=4, aug=2, val_puzzles=2, test_puzzles=10))
    assert meta["puzzles"] == {"train": 4, "val": 2, "test": 3}  # all of test.csv when fewer than asked
    assert len(ds) == 4 * 3 + 2 + 3
    originals = {tuple(q) for q, _, _ in read}
    start, stop = meta["splits"]["train"]
    assert all(tuple(ds[i]["question"]) in originals for i in range(start, stop, 3))  # aug 0 is the original


def test_csv_data_keeps_every_rating_and_full_test_takes_all_of_test_csv(tmp_path):
    rows = [(source, question, answer, rating) for source, question, answer, rating in _csv_rows(14, 4)]
    rows = [(source, question, answer, 0 if i % 2 else 50) for i, (source, question, answer, _) in enumerate(rows)]
    _write_csv(tmp_path / "train.csv", rows[:8])  # half rated 0, half 50: a filter would leave 4 of 8
    _write_csv(tmp_path / "test.csv", rows[8:])
    asked = sudoku.Recipe(train_puzzles=5, aug=1, val_puzzles=3, test_puzzles=2, min_rating=20, max_blanks=9)
    ds, meta = sudoku.from_csv(tmp_path, asked)
    assert meta["puzzles"] == {"train": 5, "val": 3, "test": 2}  # all 8 of train.csv used: no rating filter
    assert meta["recipe"]["min_rating"] == 0 and meta["full_test"] is False
    originals = [*range(0, meta["splits"]["train"][1], 2), *range(*meta["splits"]["val"])]
    assert sorted(int(ds[i]["rating"]) for i in originals) == [0] * 4 + [50] * 4
    _, full = sudoku.from_csv(tmp_path, asked, full_test=True)
    assert full["puzzles"]["test"] == 6 and full["full_test"] is True  # every row of test.csv
    # The generator's settings do not split the CSV cache; the full test does.
    plain = sudoku.Recipe(train_puzzles=5, aug=1, val_puzzles=3, test_puzzles=2)
    assert sudoku.csv_key(tmp_path, asked) == sudoku.csv_key(tmp_path, plain)
    assert sudoku.csv_key(tmp_path, asked, full_test=True) != sudoku.csv_key(tmp_path, asked)


@pytest.mark.parametrize("flags, fragment", [
    (["--from-csv", "CSV", "--min-rating", "3"], "--min-rating 3 applies to generated puzzles"),
    (["--full-test"], "--full-test needs --from-csv DIR"),
], ids=["min-rating-with-csv", "full-test-without-csv"])
def test_cli_refuses_generator_and_csv_flags_out_of_place(flags, fragment, tmp_path):
    rows = _csv_rows(6, 6)
    _write_csv(tmp_path / "train.csv", rows[:4])
    _write_csv(tmp_path / "test.csv", rows[4:])
    out = tmp_path / "built"
    command = [sys.executable, "-m", "toolkit.data.sudoku", "build", "--out", str(out), "--train-puzzles", "2",
               "--aug", "1", "--val-puzzles", "1", "--test-puzzles", "1",
               *[str(tmp_path) if flag == "CSV" else flag for flag in flags]]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and fragment in errors[0], done.stderr
    assert not out.exists()


def test_a_csv_with_a_byte_order_mark_or_crlf_line_ends_reads_as_the_plain_one(tmp_path):
    rows = _csv_rows(3, 5)
    _write_csv(tmp_path / "plain.csv", rows)
    plain = (tmp_path / "plain.csv").read_bytes()
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + plain)  # Excel's "CSV UTF-8"
    (tmp_path / "crlf.csv").write_bytes(plain.replace(b"\n", b"\r\n"))
    (tmp_path / "both.csv").write_bytes(b"\xef\xbb\xbf" + plain.replace(b"\n", b"\r\n"))
    expected = sudoku.read_csv(tmp_path / "plain.csv")
    for name in ("bom.csv", "crlf.csv", "both.csv"):
        assert sudoku.read_csv(tmp_path / name) == expected, name


def test_cli_builds_a_dataset_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "built"
    command = [sys.executable, "-m", "toolkit.data.sudoku", "build", "--out", str(out), "--train-puzzles", "3",
               "--aug", "2", "--val-puzzles", "1", "--test-puzzles", "2", "--max-blanks", "20", "--seed", "7"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"] == [0, 9] and meta["recipe"]["seed"] == 7
    ds, loaded = sudoku.load_built(out)
    assert loaded == meta and len(ds) == 12
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2
    assert [line for line in again.stderr.splitlines() if line.startswith("error:")] == [
        f"error: --out {out} already holds a dataset; choose another directory (nothing is overwritten)"]


def test_a_directory_that_is_not_a_dataset_is_refused(tmp_path):
    with pytest.raises(UsageError, match="is not a Sudoku dataset"):
        sudoku.load_built(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        sudoku.load_built(tmp_path / "missing")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("sudoku") / "built"
    command = [sys.executable, "-m", "toolkit.data.sudoku", "build", "--out", str(out), "--train-puzzles", "4",
               "--aug", "2", "--val-puzzles", "2", "--test-puzzles", "3", "--max-blanks", "20", "--seed", "5"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=120)
    return out


def _rewrite_rows(directory, edit):
    ds = datasets.load_from_disk(str(directory / sudoku.DATASET_DIR))
    table = ds.to_dict()
    edit(table)
    shutil.rmtree(directory / sudoku.DATASET_DIR)
    datasets.Dataset.from_dict(table, features=ds.features).save_to_disk(str(directory / sudoku.DATASET_DIR))


def _edit_meta(directory, **changes):
    meta = json.loads((directory / sudoku.META_FILE).read_text())
    meta.update(changes)
    (directory / sudoku.META_FILE).write_text(json.dumps(meta))


def _copy_row(table, source, target):
    for column in ("question", "answer"):
        table[column][target] = table[column][source]


def _two_solutions_at_row_15(table):
    """Blank a deadly pattern (two rows x two columns in two boxes whose digits can swap) of row 15's answer: the
    puzzle keeps most givens and gains a second solution."""
    answer = np.asarray(table["answer"][15]).reshape(9, 9)
    for r1, r2 in ((a, b) for a in range(9) for b in range(a + 1, 9) if a // 3 == b // 3):
        for c1, c2 in ((a, b) for a in range(9) for b in range(a + 1, 9) if a // 3 != b // 3):
            if answer[r1, c1] == answer[r2, c2] and answer[r1, c2] == answer[r2, c1]:
                question = answer.copy()
                question[[r1, r1, r2, r2], [c1, c2, c1, c2]] = 0
                table["question"][15] = question.ravel().tolist()
                return
    raise AssertionError("no deadly pattern in this answer")


HOSTILE_BUILT = {
    "test split equals train": (lambda d: _edit_meta(d, splits={"train": [0, 12], "val": [12, 14], "test": [0, 12]}),
                                "are not three consecutive parts"),
    "overlapping splits": (lambda d: _edit_meta(d, splits={"train": [0, 13], "val": [12, 14], "test": [14, 17]}),
                           "are not three consecutive parts"),
    "split past the end": (lambda d: _edit_meta(d, splits={"train": [0, 12], "val": [12, 14], "test": [14, 99]}),
                           "are not three consecutive parts of the 17 rows"),
    "aug count off": (lambda d: _edit_meta(d, aug=3),
                      "the train split holds 12 rows, but meta.json records 4 puzzles x 4"),
    "a test puzzle seen in training": (lambda d: _rewrite_rows(d, lambda t: _copy_row(t, 0, 16)),
                                       "test puzzle 8 repeats train puzzle 0 (a test puzzle seen in training)"),
    "a puzzle twice in one split": (lambda d: _rewrite_rows(d, lambda t: _copy_row(t, 12, 13)),
                                    "val puzzle 5 repeats val puzzle 4"),
    "all blanks (many solutions)": (lambda d: _rewrite_rows(d, lambda t: t["question"].__setitem__(14, [0] * 81)),
                                    "test puzzle 6 has 0 givens"),
    "an answer that does not solve": (lambda d: _rewrite_rows(d, lambda t: t["answer"].__setitem__(
        15, t["answer"][15][1:] + t["answer"][15][:1])), "the answer of test puzzle 7 does not solve it"),
    "meta not numbers": (lambda d: _edit_meta(d, aug="two"), "are not numbers"),
    "two solutions, 17+ givens": (lambda d: _rewrite_rows(d, _two_solutions_at_row_15), "test puzzle 7 has more "
                                  "than one solution"),
    "a puzzle with no blank": (lambda d: _rewrite_rows(d, lambda t: t["question"].__setitem__(14, t["answer"][14])),
                               "test puzzle 6 has no blank cell: nothing to solve, and its blank-cell accuracy would "
                               "be 0/0"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BUILT))
def test_hostile_built_datasets_are_one_line(case, built, tmp_path):
    edit, fragment = HOSTILE_BUILT[case]
    copy = shutil.copytree(built, tmp_path / "copy")
    edit(copy)
    with pytest.raises(UsageError) as error:
        sudoku.load_built(copy)
    assert "\n" not in str(error.value) and fragment in str(error.value), str(error.value)


def test_the_built_dataset_itself_passes(built):
    ds, meta = sudoku.load_built(built)
    assert len(ds) == 4 * 3 + 2 + 3 and meta["aug"] == 2


def _good_line(seed=8):
    source, question, answer, rating = _csv_rows(1, seed)[0]
    return f"{source},{question},{answer},{rating}\n"


_ANSWER = "".join(map(str, SOLUTION))
HEADER = "source,question,answer,rating\n"


def _with_row(source="bad", question="." * 81, answer=_ANSWER, rating="0") -> bytes:
    """A good file whose third line is the row given (each field a good value unless named)."""
    return f"{HEADER}{_good_line(9)}{source},{question},{answer},{rating}\n".encode()


# Each a whole file (bytes) and a fragment of its one error line; the good rows come from the generator.
HOSTILE_CSV = {
    "empty file": (b"", "the header is None"),
    "only the header": (HEADER.encode(), "holds no puzzles"),
    "another header": (b"id,puzzle,solution,difficulty\n", "line 1: the header is"),
    "three fields": (HEADER.encode() + b"a,b,c\n", "line 2: 3 fields; expected 4"),
    "five fields": (lambda: _with_row(rating="1,extra"), "line 3: 5 fields; expected 4"),
    "a word for a rating": (lambda: _with_row(rating="hard"), "rating 'hard' is not a non-negative integer"),
    "a negative rating": (lambda: _with_row(rating="-1"), "rating '-1' is not a non-negative integer"),
    "latin-1 bytes": (HEADER.encode() + b"\xe9t\xe9,x,y,1\n", "is not a text CSV (not UTF-8)"),
    "utf-16": (lambda: _with_row().decode().encode("utf-16"), "is not a text CSV (not UTF-8)"),
    "a question of 82 characters": (lambda: _with_row(question="." * 82), "line 3: question has 82 characters"),
    "a question of 80 characters": (lambda: _with_row(question="." * 80), "line 3: question has 80 characters"),
    "a letter in the question": (lambda: _with_row(question="x" + "." * 80), "question holds 'x' at column 1"),
    "a zero in the answer": (lambda: _with_row(answer=_ANSWER[:-1] + "0"), "line 3: answer holds '0'"),
    "an answer that breaks the rules": (lambda: _with_row(answer="11" + _ANSWER[2:]), "not a valid Sudoku solution"),
    "an answer that changes a given": (lambda: _with_row(question="9" + "." * 80), "changes a given digit"),
    "a NUL byte in the source": (lambda: _with_row(source="bad\x00"), "line 3: source holds a NUL byte"),
    "a NUL byte in the rating": (lambda: _with_row(rating="3\x00"), "line 3: rating holds a NUL byte"),
    "a superscript two for a rating": (lambda: _with_row(rating="\u00b2"),
                                       "line 3: rating '\u00b2' is not a non-negative integer of ASCII digits 0-9"),
    "an Arabic-Indic three for a rating": (lambda: _with_row(rating="\u0663"),
                                           "line 3: rating '\u0663' is not a non-negative integer of ASCII digits"),
    "a 5,000-digit rating": (lambda: _with_row(rating="9" * 5000),
                             "line 3: rating '999999999999'... (5000 characters) is not a non-negative integer"),
    "a rating past int32": (lambda: _with_row(rating="2147483648"), "rating '2147483648' is not a non-negative "
                            "integer of ASCII digits 0-9 up to 2147483647"),
    "an Arabic-Indic digit in the question": (lambda: _with_row(question="\u0663" + "." * 80),
                                              "line 3: question holds '\u0663' at column 1"),
    "a question with no blank": (lambda: _with_row(question=_ANSWER), "line 3: the question has no blank ('.' or "
                                 "'0'): nothing to solve"),
}


def test_a_directory_in_place_of_the_csv_is_one_line(tmp_path):
    (tmp_path / "train.csv").mkdir()
    with pytest.raises(UsageError, match="train.csv cannot be read"):
        sudoku.read_csv(tmp_path / "train.csv")


@pytest.mark.parametrize("case", list(HOSTILE_CSV))
def test_hostile_csv_files_are_one_line(case, tmp_path):
    content, fragment = HOSTILE_CSV[case]
    path = tmp_path / "train.csv"
    path.write_bytes(content() if callable(content) else content)
    with pytest.raises(UsageError) as error:
        sudoku.read_csv(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value) and fragment in str(error.value), str(
        error.value)
