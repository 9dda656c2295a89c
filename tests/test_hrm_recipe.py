"""The HRM recipe end to end through real launchers on tiny generated Sudoku: 1 and 2 gloo processes (world size
seen inside) alike with SGD (weights and the puzzle-embedding table to 1e-5, the same validation and test counts)
and with AdamATan2 (losses to 1e-4), bit-identical resume with the carry in the checkpoint, `verify`, and bad inputs
(one error line naming the file and row, exit 2, nothing created)."""

import csv

import pytest
import torch
from conftest import (
    DATA_CACHE,
    assert_refused,
    final_weights,
    logged_losses,
    one_and_two_process_runs,
    ranks_seen,
    read_json,
    run_recipe,
)

from toolkit.data.sudoku import generate_puzzle
from toolkit.tools.verify import verify_run

# one worker for the module: its module-scoped runs are made once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hrm-recipe")]

# 48 training puzzles (3 batches of 16 an epoch), a 16-wide model, 2 segments at most: seconds per run.
TINY_HRM = ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "48", "--aug", "1", "--val-puzzles", "16",
            "--test-puzzles", "16", "--max-blanks", "8", "--hidden", "16", "--heads", "2", "--expansion", "2",
            "--batch-size", "16", "--halt-max-steps", "2", "--exploration-prob", "0.5", "--warmup-steps", "2",
            "--threads", "1", "--log-with", "none"]
STEPS = 6
SGD = [*TINY_HRM, "--optimizer", "sgd", "--lr", "0.5", "--max-steps", str(STEPS), "--eval-every-steps", "3",
       "--log-with", "csv", "--log-every", "1"]
ADAM = [*TINY_HRM, "--max-steps", str(STEPS), "--eval-every-steps", "3", "--log-with", "csv", "--log-every", "1"]


def test_one_and_two_processes_train_alike_with_sgd_and_count_every_puzzle_once(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    first = run_recipe([*SGD, "--output-dir", str(one)], recipe="hrm", config="cpu.yaml")
    second = run_recipe([*SGD, "--output-dir", str(two)], recipe="hrm", config="cpu_2proc.yaml")
    assert ranks_seen(first.stderr) == {(0, 1)}
    assert ranks_seen(second.stderr) == {(0, 2), (1, 2)} and "backend=gloo" in second.stderr
    assert verify_run(one, expect_world_size=1) == []
    assert verify_run(two, expect_world_size=2, expect_backend="gloo") == []
    w1, w2 = final_weights(one, STEPS), final_weights(two, STEPS)
    assert "puzzle_emb.table" in w1 and w1["puzzle_emb.table"].abs().sum() > 0  # the sparse table was trained
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    s1, s2 = read_json(one / "summary.json"), read_json(two / "summary.json")
    assert s1["world_size"] == 1 and s2["world_size"] == 2
    for summary in (s1, s2):
        assert summary["test_metrics_at_best"]["test_puzzles"] == 16  # each puzzle once, none padded in
    for key in ("test_exact_accuracy", "test_blank_accuracy", "test_token_accuracy", "test_q_halt_accuracy"):
        assert s1["test_metrics_at_best"][key] == pytest.approx(s2["test_metrics_at_best"][key], abs=1e-9), key
    assert s1["final_metrics"] == pytest.approx(s2["final_metrics"], abs=1e-9)
    # Training metrics are sums over ranks divided by counts: the same whatever the process count.
    logged = [{(r["step"], r["name"]): float(r["value"]) for r in csv.DictReader(open(d / "log.csv"))
               if r["name"].startswith("train/")} for d in (one, two)]
    assert logged[0].keys() == logged[1].keys() and ("6", "train/exact_accuracy") in logged[0]
    assert logged[0] == pytest.approx(logged[1], rel=1e-5, abs=1e-9)


@pytest.fixture(scope="module")
def adam_runs(tmp_path_factory):
    """Uninterrupted AdamATan2 runs, 1 and 2 processes."""
    return one_and_two_process_runs(ADAM, recipe="hrm", root=tmp_path_factory.mktemp("hrm-adam"))


def test_two_processes_match_one_process_loss_curve_and_log_every_metric(adam_runs):
    l1, l2 = logged_losses(adam_runs[None]), logged_losses(adam_runs["cpu_2proc.yaml"])
    assert sorted(l1) == sorted(l2) == list(range(1, STEPS + 1))
    worst = max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1)
    assert worst < 1e-4, worst
    assert l1[STEPS] < l1[1]  # it trained
    names = {row["name"] for row in csv.DictReader(open(adam_runs["cpu_2proc.yaml"] / "log.csv"))}
    for name in ("train/lm_loss", "train/q_halt_loss", "train/q_continue_loss", "train/token_accuracy",
                 "train/exact_accuracy", "train/q_halt_accuracy", "train/mean_segments", "train/lr"):
        assert name in names, name
    segments = [float(r["value"]) for r in csv.DictReader(open(adam_runs[None] / "log.csv"))
                if r["name"] == "train/mean_segments"]
    assert segments and all(1 <= s <= 2 for s in segments)
    assert verify_run(adam_runs["cpu_2proc.yaml"], expect_world_size=2, expect_backend="gloo") == []


@pytest.mark.parametrize("config", [None, "cpu_2proc.yaml"], ids=["1proc", "2proc"])
def test_resumed_run_is_bit_identical_to_uninterrupted(config, adam_runs, tmp_path):
    """Stopped at step 4 (mid-epoch, puzzles still thinking in the carry), resumed to step 6."""
    straight, resumed = adam_runs[config], tmp_path / "resumed"
    run_recipe([*ADAM, "--max-steps", "4", "--output-dir", str(resumed)], recipe="hrm", config=config)
    carry = torch.load(resumed / "checkpoints" / "step_4" / "rank_state_0.pt", weights_only=False)
    assert carry["carry"]["state"]["z_h"].shape[0] == 16 // (2 if config else 1)
    second = run_recipe([*ADAM, "--output-dir", str(resumed), "--resume-from", "auto"], recipe="hrm", config=config)
    assert "resuming from" in second.stdout and "step_4" in second.stdout
    a, b = (d / "checkpoints" / f"step_{STEPS}" / "model.safetensors" for d in (straight, resumed))
    assert a.read_bytes() == b.read_bytes()
    assert logged_losses(straight) == logged_losses(resumed)  # the steps after the resume too, bit for bit
    rows = [[r for r in csv.DictReader(open(d / "metrics.csv")) if r["step"] == str(STEPS)][0]
            for d in (straight, resumed)]
    assert rows[0] == {**rows[1], **{k: rows[0][k] for k in rows[0] if "time" in k or "per_sec" in k
                                     or k.endswith("_util_avg") or k == "peak_memory_mb"}}
    summary = read_json(resumed / "summary.json")  # wall time sums the lives' kept work, not only the last life
    assert summary["wall_time_sec"] > summary["wall_time_this_life_sec"] > 0
    assert verify_run(resumed) == []


def test_batches_cross_epochs_and_sudoku_1k_without_csvs_says_what_its_figure_needs(tmp_path):
    """40 puzzles in batches of 16 for 2 epochs: 5 steps (80 puzzles drawn; drop_last per epoch would give 4 and
    leave 8 unseen each epoch), with the sudoku-1k preset made tiny, on generated puzzles."""
    tiny = list(TINY_HRM)
    tiny[tiny.index("--train-puzzles") + 1] = "40"
    out = tmp_path / "run"
    done = run_recipe(["--preset", "sudoku-1k", *tiny, "--h-layers", "1", "--l-layers", "1", "--h-cycles", "1",
                       "--l-cycles", "1", "--min-rating", "0", "--epochs", "2", "--eval-every", "2",
                       "--output-dir", str(out)], recipe="hrm")
    said = [line for line in (done.stdout + done.stderr).splitlines() if "55% exact accuracy" in line]
    assert len(said) == 1 and "Sudoku-Extreme" in said[0] and "generated puzzles" in said[0], said
    summary = read_json(out / "summary.json")
    assert summary["global_step"] == 5 and summary["epochs_completed"] == 2
    progress = read_json(out / "checkpoints" / "step_5" / "progress.json")
    assert progress["samples_seen"] == 80
    assert verify_run(out) == []


def test_uneven_epochs_resume_bit_identical_and_two_processes_train_as_one(tmp_path):
    """40 puzzles in batches of 16, one stream: epochs of 3, 2, 3 batches (the third batch spans epochs 0 and 1).
    Stopped at step 4 (inside epoch 1, after the spanning batch) and resumed to step 7 with 2 processes."""
    uneven = [*ADAM, "--train-puzzles", "40", "--max-steps", "7"]
    straight, resumed, one = tmp_path / "straight", tmp_path / "resumed", tmp_path / "one"
    run_recipe([*uneven, "--output-dir", str(one)], recipe="hrm")
    run_recipe([*uneven, "--output-dir", str(straight)], recipe="hrm", config="cpu_2proc.yaml")
    run_recipe([*uneven, "--max-steps", "4", "--output-dir", str(resumed)], recipe="hrm", config="cpu_2proc.yaml")
    assert read_json(resumed / "checkpoints" / "step_4" / "progress.json")["epoch"] == 1
    run_recipe([*uneven, "--output-dir", str(resumed), "--resume-from", "auto"], recipe="hrm", config="cpu_2proc.yaml")
    a, b = (d / "checkpoints" / "step_7" / "model.safetensors" for d in (straight, resumed))
    assert a.read_bytes() == b.read_bytes()
    assert logged_losses(straight) == logged_losses(resumed)
    assert read_json(straight / "summary.json")["epochs_completed"] == 2  # 3 + 2 batches, then 2 of epoch 2
    l1, l2 = logged_losses(one), logged_losses(straight)
    assert sorted(l1) == sorted(l2) == list(range(1, 8))
    assert max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1) < 1e-4
    assert verify_run(resumed) == []


def test_full_test_tests_every_puzzle_of_test_csv(tmp_path):
    folder = _csv_folder()(tmp_path)  # 4 puzzles in train.csv, 4 in test.csv
    out = tmp_path / "run"
    run_recipe([*TINY_HRM, "--cache-dir", str(tmp_path / "cache"), "--data", folder, "--full-test",
                "--train-puzzles", "2", "--val-puzzles", "1", "--test-puzzles", "1", "--batch-size", "2",
                "--max-steps", "2", "--output-dir", str(out)], recipe="hrm")
    assert read_json(out / "summary.json")["test_metrics_at_best"]["test_puzzles"] == 4  # not --test-puzzles 1
    assert verify_run(out) == []


# ---- bad input: one `error:` line naming the file and row, exit 2, nothing created -----------------------------


def _csv_folder(bad_question=None, bad_rating=None):
    """A Sudoku-Extreme-style folder (train.csv, test.csv) of generated puzzles; line 3 of train.csv broken."""

    def make(case_dir):
        import random

        rng = random.Random(0)
        folder = case_dir / "extreme"
        folder.mkdir()
        for name in ("train.csv", "test.csv"):
            rows = []
            for _ in range(4):
                question, answer, rating = generate_puzzle(rng, max_blanks=8)
                rows.append(["gen", "".join(str(d) if d else "." for d in question), "".join(map(str, answer)),
                             str(rating)])
            if name == "train.csv" and bad_question is not None:
                rows[1][1] = bad_question(rows[1][1])
            if name == "train.csv" and bad_rating is not None:
                rows[1][3] = bad_rating
            with open(folder / name, "w", newline="") as handle:
                csv.writer(handle).writerows([["source", "question", "answer", "rating"], *rows])
        return str(folder)

    return make


def _built_dir(case_dir):
    """The layout of a built dataset (meta.json and dataset/): its test split is fixed, --full-test cannot apply."""
    built = case_dir / "built"
    (built / "dataset").mkdir(parents=True)
    (built / "meta.json").write_text("{}")
    return str(built)


BAD_INPUTS = [
    ("data-missing", ["--data", "/no/such/sudoku"], ["--data /no/such/sudoku", "does not exist"]),
    ("csv-grid-too-short", ["--data", _csv_folder(lambda q: q[:80])], ["train.csv line 3", "80 characters"]),
    ("csv-non-digit", ["--data", _csv_folder(lambda q: "x" + q[1:])], ["train.csv line 3", "'x'", "column 1"]),
    ("csv-no-blank", ["--data", _csv_folder(lambda q: q.replace(".", "1"))], ["train.csv line 3", "no blank"]),
    ("csv-rating-superscript", ["--data", _csv_folder(bad_rating="\u00b2")],
     ["train.csv line 3", "rating '\u00b2'", "ASCII digits"]),
    ("preset", ["--preset", "sudoku-4k"], ["--preset", "sudoku-4k"]),
    ("heads-do-not-divide", ["--heads", "3"], ["--hidden 16", "--heads 3"]),
    ("grad-accum", ["--grad-accum", "2"], ["--grad-accum 2", "carry"]),
    ("batch-larger-than-puzzles", ["--batch-size", "64"], ["--batch-size 64", "48 training puzzles"]),
    ("max-blanks", ["--max-blanks", "0"], ["--max-blanks 0", "1 .. 81"]),
    ("exploration", ["--exploration-prob", "1.5"], ["--exploration-prob 1.5", "[0, 1]"]),
    ("full-test-generated", ["--full-test"], ["--full-test", "generated puzzles have no test.csv"]),
    ("full-test-built", ["--full-test", "--data", _built_dir], ["--full-test", "not a folder of Sudoku-Extreme CSVs"]),
    ("full-test-value", ["--full-test", "yes"], ["yes"]),
]


@pytest.mark.parametrize("flags, fragments", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_created(flags, fragments, tmp_path):
    flags = [flag(tmp_path) if callable(flag) else flag for flag in flags]
    cache = tmp_path / "cache"  # its own cache: a failed conversion must leave nothing there either
    assert_refused([*TINY_HRM, "--cache-dir", str(cache), *flags, "--output-dir", str(tmp_path / "run")], fragments,
                   recipe="hrm", case_dir=tmp_path)
