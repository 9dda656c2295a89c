"""HRM's evaluation against the reference's habits:

- --eval-full-test-every N: the whole test split every N optimizer steps, as the reference's pretrain.py at every
  evaluation; logged at its step (full_test_*), held by every metrics.csv row (full_test_step: which); the same
  weights as a run without it, also across a resume (the latest full test is in the checkpoint); under 2 processes
  each puzzle counted once.
- sudoku-1k's forward precision: bf16 on a GPU as the reference's forward_dtype, fp32 on a CPU said in one line
  (the choice tested with a stand-in device type; a recipe run on this CPU says it).
- --init-from-reference: a checkpoint in the reference's layout (a torch.save'd state dict, `_orig_mod.` prefix or
  not), built here from the transcription in tests/test_hrm_reference.py, loads by the name map; our forward then
  equals the transcription's. What does not fit is one line.
"""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import test_hrm_reference as ref
import torch
import yaml
from conftest import DATA_CACHE, assert_refused, final_weights, logged_losses, read_json, run_recipe

from recipes.hrm import preset_precision
from toolkit.errors import UsageError
from toolkit.models.hrm import HRM
from toolkit.models.hrm_reference_checkpoint import load_reference_checkpoint, our_name, refuse_other_settings
from toolkit.tools.verify import verify_run

# ---- the reference's checkpoint -------------------------------------------------------------------------------


def reference_model(positions: str = "rope", hidden: int = 32, heads: int = 4, layers: int = 2, expansion=2.0,
                    puzzle_ids: int = 5, seq: int = ref.SEQ, seed: int = 1):
    """The transcription (ACTLossHead(ACT(Inner))) in float64 with random weights of its own; H_init and L_init
    rounded to bfloat16, the dtype the reference keeps them in."""
    config = SimpleNamespace(batch_size=ref.ROWS, seq_len=seq, puzzle_emb_ndim=hidden,
                             num_puzzle_identifiers=puzzle_ids, vocab_size=ref.VOCAB, H_cycles=2, L_cycles=3,
                             H_layers=layers, L_layers=layers, hidden_size=hidden, expansion=expansion,
                             num_heads=heads, pos_encodings=positions, rms_norm_eps=1e-5, rope_theta=10000.0,
                             halt_max_steps=ref.MAX_STEPS, halt_exploration_prob=0.5)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = ref.ACTLossHead(ref.ACT(config, ref.exploration_draws(1, ref.MAX_STEPS)),
                                loss_type="stablemax_cross_entropy")
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            scale = 1.0 if name.endswith(("_init", "puzzle_emb.weights")) else 1.0 / tensor.shape[-1] ** 0.5
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * scale)
            if name.endswith("_init"):
                tensor.copy_(tensor.to(torch.bfloat16))
    return model


def save_reference(model, path, compiled: bool = True, dtype=None, extra: dict | None = None):
    """As pretrain.py's save_train_state: torch.save(model.state_dict()) (torch.compile's `_orig_mod.` names)."""
    prefix = "_orig_mod." if compiled else ""
    state = {f"{prefix}{name}": tensor.to(torch.bfloat16 if name.endswith("_init") else dtype or tensor.dtype)
             for name, tensor in model.state_dict().items()}
    torch.save({**state, **(extra or {})}, path)
    return path


def ours_like(positions: str = "rope", **sizes) -> HRM:
    torch.manual_seed(7)  # other weights than the reference's: the load must replace every one
    settings = dict(num_puzzle_ids=5, hidden=32, heads=4, expansion=2.0, h_layers=2, l_layers=2, h_cycles=2,
                    l_cycles=3, halt_max_steps=ref.MAX_STEPS, exploration_prob=0.5, positions=positions)
    return HRM(ref.VOCAB, ref.SEQ, **{**settings, **sizes}).double()


@pytest.mark.parametrize("positions, compiled", [("rope", True), ("learned", False)])
def test_a_reference_checkpoint_loads_and_our_forward_equals_the_transcriptions(positions, compiled, tmp_path):
    reference = reference_model(positions)
    path = save_reference(reference, tmp_path / "step_1000", compiled=compiled)
    ours = ours_like(positions)
    lines = load_reference_checkpoint(ours, path)
    assert lines == [f"--init-from-reference {path}: {len(ours.state_dict())} tensors of the reference's checkpoint "
                     "loaded"]
    assert {our_name(name) for name in reference.state_dict()} == set(ours.state_dict())
    assert ours.h_init.dtype == torch.float64  # ours keeps its dtype; the bfloat16 values exactly
    assert torch.equal(ours.h_init, reference.model.inner.H_init)
    # Evaluation: every segment alike, the Q values too.
    ours.eval()
    reference.eval()
    data = ref.make_batch(0)
    ours_carry, reference_carry = ours.initial_carry(data), reference.model.initial_carry(ref.as_reference(data))
    with torch.no_grad():
        for _ in range(ref.MAX_STEPS):
            out = ours(ours_carry, data)
            reference_carry, _, _, ref_out, _ = reference(carry=reference_carry, batch=ref.as_reference(data))
            ref.close(out["logits"], ref_out["logits"], "logits")
            ref.close(out["q_halt"], ref_out["q_halt_logits"], "q_halt")
            ref.close(out["q_continue"], ref_out["q_continue_logits"], "q_continue")
            ours_carry = out["carry"]
    # Training segments (the puzzle-embedding rows, exploration, the Q target): the same decisions and values.
    ours.train()
    reference.train()
    ours_carry = ours.initial_carry(ref.make_batch(0))
    reference_carry = reference.model.initial_carry(ref.as_reference(ref.make_batch(0)))
    with torch.no_grad():
        for segment in range(3):
            data, step = ref.make_batch(segment), segment + 1
            out = ours(ours_carry, data, explore_key=(ref.SEED, ref.EXPLORATION, step))
            reference.model.exploration_draws = ref.exploration_draws(step, ref.MAX_STEPS)
            reference_carry, _, _, ref_out, _ = reference(carry=reference_carry, batch=ref.as_reference(data))
            assert out["halted"].tolist() == reference_carry.halted.tolist()
            ref.close(out["logits"], ref_out["logits"], "logits")
            ref.close(out["target_q_continue"], ref_out["target_q_continue"], "target_q_continue")
            ours_carry = out["carry"]


def test_what_does_not_fit_is_one_line(tmp_path):
    reference = reference_model()
    extra = {"_orig_mod.model.inner.future_buffer": torch.zeros(3), "_orig_mod.optimizer_step": torch.zeros(1)}
    path = save_reference(reference, tmp_path / "step_1", extra=extra)
    lines = load_reference_checkpoint(ours_like(), path)  # tensors with no counterpart: listed, left out
    assert lines[1] == (f"--init-from-reference {path}: 2 tensor(s) with no counterpart in this model left out: "
                        "_orig_mod.model.inner.future_buffer, _orig_mod.optimizer_step")

    def refused(model, path) -> str:
        with pytest.raises(UsageError) as caught:
            load_reference_checkpoint(model, path)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    narrow = ours_like(hidden=16)
    assert "_orig_mod.model.inner.H_init has shape [32] where this model's h_init has [16]" in refused(narrow, path)
    deeper = ours_like(h_layers=3)
    said = refused(deeper, path)
    assert "lacks this model's h_level.blocks.2.attention.qkv.weight" in said and "--h-layers" in said, said
    assert "does not exist" in refused(ours_like(), tmp_path / "nothing")
    assert "is not a file" in refused(ours_like(), tmp_path)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert "could not be read as a torch.save'd state dict" in refused(ours_like(), tmp_path / "notes.txt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    assert "holds no state dict of tensors" in refused(ours_like(), tmp_path / "list.pt")


def test_the_references_record_of_its_settings_is_compared_when_it_is_beside_the_checkpoint(tmp_path):
    """pretrain.py writes all_config.yaml beside its checkpoints: heads and cycles, which no shape shows, are checked
    against it (a checkpoint alone: nothing to compare)."""
    ours = {"--hidden": 512, "--heads": 8, "--expansion": 4.0, "--h-layers": 4, "--l-layers": 4, "--h-cycles": 2,
            "--l-cycles": 2, "--positions": "rope"}
    path = tmp_path / "step_26040"
    refuse_other_settings(path, ours)
    arch = {"name": "hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1", "hidden_size": 512, "num_heads": 8,
            "expansion": 4, "H_layers": 4, "L_layers": 4, "H_cycles": 2, "L_cycles": 2, "pos_encodings": "rope",
            "halt_max_steps": 16, "puzzle_emb_ndim": 512}
    (tmp_path / "all_config.yaml").write_text(yaml.safe_dump({"arch": arch, "global_batch_size": 768}))
    refuse_other_settings(path, ours)  # the same settings (expansion 4 == 4.0)
    with pytest.raises(UsageError) as caught:
        refuse_other_settings(path, {**ours, "--heads": 4, "--l-cycles": 3})
    assert str(caught.value) == (f"--init-from-reference {path} was trained with other settings ({tmp_path}/"
                                 "all_config.yaml): --heads 4 here, 8 there; --l-cycles 3 here, 2 there; give its "
                                 "values")
    (tmp_path / "all_config.yaml").write_text("arch: [unclosed")
    with pytest.raises(UsageError, match="could not be read"):
        refuse_other_settings(path, ours)


# ---- sudoku-1k's forward precision ----------------------------------------------------------------------------


def test_sudoku_1k_computes_in_bf16_on_a_gpu_and_says_when_it_keeps_fp32():
    assert preset_precision(None, "sudoku-1k", "cuda") == ("bf16", None)
    assert preset_precision(None, "sudoku-1k", "cuda", launch_config="no") == ("bf16", None)  # Accelerate's default
    value, line = preset_precision(None, "sudoku-1k", "cpu", launch_config="no")
    assert value is None and line == ("--preset sudoku-1k: fp32 on the CPU (the preset's bf16 forward, as the "
                                      "reference's, applies on a GPU; --mixed-precision bf16 asks for it here)")
    # A choice made is kept: the flag's, or a launch config's
    assert preset_precision("no", "sudoku-1k", "cuda") == ("no", None)
    assert preset_precision("bf16", "sudoku-1k", "cpu") == ("bf16", None)
    assert preset_precision(None, "sudoku-1k", "cuda", launch_config="fp16") == (None, None)
    assert preset_precision(None, "cpu-small", "cuda") == (None, None)  # other presets: as before
    assert preset_precision(None, None, "cuda") == (None, None)


# ---- the recipe: --eval-full-test-every, --init-from-reference, sudoku-1k on a CPU ------------------------------

# 48 training puzzles in batches of 16, a 16-wide model of 1+1 layers, 17 test puzzles (2 processes: shares of 9
# and 8, the last batch padded and the padding dropped by gather_for_metrics)
TINY = ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "48", "--aug", "1", "--val-puzzles", "16",
        "--test-puzzles", "17", "--max-blanks", "8", "--hidden", "16", "--heads", "2", "--expansion", "2",
        "--batch-size", "16", "--halt-max-steps", "2", "--exploration-prob", "0.5", "--warmup-steps", "2",
        "--threads", "1", "--eval-every-steps", "3", "--log-with", "csv", "--log-every", "1"]
FULL_TEST = ["full_test_exact_accuracy", "full_test_blank_accuracy", "full_test_token_accuracy",
             "full_test_q_halt_accuracy", "full_test_puzzles"]


def tiny_reference(path):
    """A reference checkpoint of the TINY model's sizes (float32, H_init/L_init bf16, compiled names)."""
    model = reference_model(hidden=16, heads=2, layers=1, puzzle_ids=1, seq=81, seed=3)
    return save_reference(model, path, dtype=torch.float32), model


def rows(run_dir, name="metrics.csv"):
    return list(csv.DictReader(open(run_dir / name)))


def logged(run_dir, prefix="full_test_") -> dict:
    return {(int(r["step"]), r["name"]): float(r["value"]) for r in rows(run_dir, "log.csv")
            if r["name"].startswith(prefix)}


@pytest.mark.slow
def test_full_test_every_n_steps_leaves_training_as_it_was_across_a_resume(tmp_path):
    """Without the flag, 6 steps; with --eval-full-test-every 4, stopped at 5 and resumed to 6: the same weights and
    losses bit for bit (both from a reference checkpoint); the full test at step 4 logged once, held by the rows at 5
    and 6 (the latter written after the resume, from the checkpoint)."""
    checkpoint, reference = tiny_reference(tmp_path / "step_500")
    start = [*TINY, "--init-from-reference", str(checkpoint)]
    plain, flagged = tmp_path / "plain", tmp_path / "flagged"
    done = run_recipe([*start, "--max-steps", "6", "--output-dir", str(plain)], recipe="hrm")
    assert f"--init-from-reference {checkpoint}: 15 tensors of the reference's checkpoint loaded" in done.stdout
    weights = final_weights(plain, 6)  # h_init, l_init: buffers training leaves alone
    assert torch.equal(weights["h_init"], reference.model.inner.H_init.float())
    run_recipe([*start, "--eval-full-test-every", "4", "--max-steps", "5", "--output-dir", str(flagged)],
               recipe="hrm")
    again = run_recipe([*start, "--eval-full-test-every", "4", "--max-steps", "6", "--output-dir", str(flagged),
                        "--resume-from", "auto"], recipe="hrm")
    assert "step_5" in again.stdout and "tensors of the reference's checkpoint loaded" not in again.stdout
    a, b = (d / "checkpoints" / "step_6" / "model.safetensors" for d in (plain, flagged))
    assert a.read_bytes() == b.read_bytes()
    assert logged_losses(plain) == logged_losses(flagged)
    full = logged(flagged)
    assert set(full) == {(4, name) for name in FULL_TEST} and full[(4, "full_test_puzzles")] == 17
    assert logged(plain) == {}
    by_step = {r["step"]: r for r in rows(flagged)}
    assert [r["full_test_step"] for r in rows(flagged)] == ["", "4", "4"]  # rows at steps 3, 5, 6
    for name in FULL_TEST:
        assert float(by_step["6"][name]) == full[(4, name)], name
    timing = {"epoch_time_sec", "throughput_samples_per_sec", "data_load_time_sec", "compute_time_sec",
              "cpu_util_avg", "gpu_util_avg", "peak_memory_mb"}
    plain_row = {k: v for k, v in rows(plain)[-1].items() if k not in timing}
    assert plain_row == {k: v for k, v in by_step["6"].items() if k not in timing and not k.startswith("full_test")}
    assert verify_run(flagged) == []


@pytest.mark.slow
def test_two_processes_test_every_puzzle_once_and_sudoku_1k_says_it_keeps_fp32_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    done = run_recipe(["--preset", "sudoku-1k", *TINY, "--h-layers", "1", "--l-layers", "1", "--h-cycles", "1",
                       "--l-cycles", "1", "--min-rating", "0", "--epochs", "2", "--max-steps", "4",
                       "--eval-full-test-every", "2", "--output-dir", str(out)], recipe="hrm", config="cpu_2proc.yaml")
    said = [line for line in (done.stdout + done.stderr).splitlines() if "fp32 on the CPU" in line]
    assert len(said) == 1 and said[0].startswith("--preset sudoku-1k:"), said
    assert read_json(out / "config.json")["config"]["mixed_precision"] is None  # the launch config's: fp32
    full = logged(out)
    assert sorted({step for step, _ in full}) == [2, 4]
    assert full[(2, "full_test_puzzles")] == full[(4, "full_test_puzzles")] == 17  # each once, none padded in
    assert all(0 <= value <= 1 for (_, name), value in full.items() if name != "full_test_puzzles")
    assert [r["full_test_step"] for r in rows(out)] == ["2", "4"]  # the rows at steps 3 and 4 (the end)
    assert verify_run(out, expect_world_size=2, expect_backend="gloo") == []


BAD = [
    ("full-test-every", ["--eval-full-test-every", "-1"], ["--eval-full-test-every -1", ">= 0"]),
    ("reference-too-wide", ["--init-from-reference", "WIDE"],
     ["--init-from-reference", "H_init has shape [32] where this model's h_init has [16]"]),
]


@pytest.mark.parametrize("flags, fragments", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_one_line_exit_2_before_anything(flags, fragments, tmp_path):
    if "WIDE" in flags:  # a checkpoint of hidden 32 for the 16-wide model: refused before any data is made
        flags = [str(save_reference(reference_model(puzzle_ids=1, seq=81), tmp_path / "wide.pt")) if f == "WIDE"
                 else f for f in flags]
    assert_refused([*TINY, "--cache-dir", str(tmp_path / "cache"), *flags, "--output-dir", str(tmp_path / "run")],
                   fragments, recipe="hrm", case_dir=tmp_path)
