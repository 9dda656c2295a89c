"""A mutation check you can run: small deliberate bugs, one at a time, each against the tests meant to catch it.

    python tests/mutations.py                 # every mutation (about 10 minutes on 2 cores)
    python tests/mutations.py --list          # the mutations, with the tests each one runs
    python tests/mutations.py --only resume-position-off-by-one ranking-ties
    make mutations

For each mutation: a copy of the checkout (the files git tracks, and new ones it does not ignore) is made in a
temporary folder, the one-line change is applied there (the text to replace must occur exactly once, else the
mutation is reported STALE: the code moved and the list needs updating), and the related tests run there with
`pytest -x`. CAUGHT: a test failed. SURVIVED: every test passed with the bug in; a hole in the suite. ERROR: pytest
could not run the tests (collection error, none selected). TIMEOUT: caught only by the time limit, which is a slow,
imprecise failure to fix. NOT HERE: a bug that only some machines can show (MKL's AVX-512 kernels), with why;
it counts neither way. The checkout itself is never changed. It is a tool, not part of `make test`.

Each mutation names the mechanism it breaks; add one for each mechanism you change.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    why: str = ""
    also: tuple[tuple[str, str, str], ...] = ()  # further (path, old, new) edits of the same bug
    # A bug that only some machines can show: None where this one can, else why not (the mutation is then NOT HERE:
    # an equivalent mutant on this machine, neither caught nor survived)
    shows_here: Callable[[], str | None] | None = None


def mkl_runs_avx512_here() -> str | None:
    """MKL's weight gradient x.T g differs from g.T x, by g's layout, only where MKL runs its AVX-512 kernels."""
    sys.path.insert(0, str(ROOT))
    from toolkit.kernels import onednn

    if onednn.products_by() == "mkl":
        return None
    return ("the products are oneDNN's here (MKL runs AVX-512 kernels on Intel's CPUs alone): MKL's two ways round "
            "give the same bits, so the bug changes nothing on this machine")


MUTATIONS = [
    # ---- four bugs the suite once let through ------------------------------------------------------------------
    Mutation("dcrnn-loss-counts-missing-readings", "recipes/dcrnn.py",
             "observed = truth > 0", "observed = truth >= 0",
             ("tests/test_objectives.py",),
             "DCRNN's masked MAE counts the missing readings (zeros)"),
    Mutation("dropout-and-clipping-made-resumable", "toolkit/run/config.py",
             '"cache_dir", "data_on_device",\n}', '"cache_dir", "data_on_device", "dropout", "max_grad_norm",\n}',
             ("tests/test_resume_rule.py",),
             "a resume with another --dropout / --max-grad-norm is accepted"),
    Mutation("dropout-and-clipping-made-resumable-and-declared", "toolkit/run/config.py",
             '"cache_dir", "data_on_device",\n}', '"cache_dir", "data_on_device", "dropout", "max_grad_norm",\n}',
             ("tests/test_resume_rule.py", "-k", "sasrec"),
             "the same, with changed values declared in the test: the resume itself must show the difference",
             also=(("tests/test_resume_rule.py", "RESUME_CHANGES = {\n",
                    'RESUME_CHANGES = {\n    "dropout": lambda run, scratch: ["--dropout", "0.5"],\n'
                    '    "max_grad_norm": lambda run, scratch: ["--max-grad-norm", "0.01"],\n'),)),
    Mutation("sha256-skips-random-states", "toolkit/run/checkpoint.py",
             'if path.stat().st_size != entry.get("bytes") or _sha256(path) != entry.get("sha256"):',
             'if path.stat().st_size != entry.get("bytes") or (not name.startswith("random_states") '
             'and _sha256(path) != entry.get("sha256")):',
             ("tests/test_checkpoint_integrity.py",),
             "damaged RNG states of the same size pass the checksum"),
    Mutation("resume-position-off-by-one", "toolkit/loop/progress.py",
             "accelerator.skip_first_batches(loader, batches_done) if batches_done",
             "accelerator.skip_first_batches(loader, batches_done + 1) if batches_done",
             ("tests/test_resume_position.py", "tests/test_exactness.py", "-k", "resume"),
             "a resumed epoch skips one batch too many"),
    # ---- one in each mechanism that keeps a run exact ---------------------------------------------------------
    Mutation("checksum-compares-sizes-only", "toolkit/run/checkpoint.py",
             ' or _sha256(path) != entry.get("sha256"):', ":",
             ("tests/test_checkpoint_integrity.py",),
             "the manifest's sha256 is never compared"),
    Mutation("keyed-dropout-depends-on-rank", "toolkit/run/randomness.py",
             "keep = lanes[state.rank * rows:(state.rank + 1) * rows]", "keep = lanes[:rows]",
             ("tests/test_randomness.py",),
             "every rank takes rank 0's rows of the global mask"),
    Mutation("ranking-ties-favour-the-target", "toolkit/run/metrics.py",
             "beats = (other_scores >= target_scores.unsqueeze(1))",
             "beats = (other_scores > target_scores.unsqueeze(1))",
             ("tests/test_metrics.py",),
             "an item tied with the target no longer ranks above it"),
    Mutation("global-mean-is-each-ranks-mean", "toolkit/run/distributed.py",
             "loss = local_sum * (accelerator.num_processes / global_count)", "loss = local_sum / count.clamp_min(1.0)",
             ("tests/test_moments.py", "-k", "gloo"),
             "each rank averages its own items, so ranks with fewer items weigh more"),
    Mutation("normalisation-uses-sample-std", "toolkit/run/distributed.py",
             "floor: float = 1e-6, ddof: int = 0", "floor: float = 1e-6, ddof: int = 1",
             ("tests/test_moments.py", "tests/test_objectives.py"),
             "the normalisation statistics divide by n - 1"),
    Mutation("hrm-q-halt-weighted-twice", "toolkit/models/hrm.py",
             "total = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)",
             "total = lm_loss + q_halt_loss + 0.5 * q_continue_loss",
             ("tests/test_objectives.py",),
             "HRM's ACT loss weighs the halting BCE 1 instead of 0.5"),
    Mutation("changed-flag-seen-only-by-type", "toolkit/run/config.py",
             "if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]",
             "if key not in RESUMABLE_CHANGES and type(old.get(key)) != type(new.get(key))]",
             ("tests/test_resume_rule.py", "-k", "refused"),
             "a flag changed to another value of the same type is accepted on resume"),
    # ---- the training objectives (tests/test_objectives.py) --------------------------------------------------
    Mutation("sasrec-loss-counts-padding", "recipes/sasrec.py",
             "    positions = targets > 0\n", "    positions = targets >= 0\n",
             ("tests/test_objectives.py",),
             "SASRec's loss is taken at padding positions too"),
    Mutation("dcrnn-loss-on-scaled-values", "recipes/dcrnn.py",
             "predicted = scaler.inverse(scaled_prediction.float())", "predicted = scaled_prediction.float()",
             ("tests/test_objectives.py",),
             "DCRNN's MAE compares scaled predictions with speeds in mph"),
    Mutation("ufs-targets-not-normalised", "recipes/ufs_emulator.py",
             '"y": model.normalise_outputs(patterns.train_targets)', '"y": patterns.train_targets',
             ("tests/test_objectives.py",),
             "the UFS emulator trains on raw targets"),
    # ---- mechanisms changed with issues 28 and 24 --------------------------------------------------------------
    Mutation("short-epoch-not-noticed", "toolkit/loop/progress.py",
             "if batches_done < batches_in_epoch:", "if batches_done < batches_in_epoch - 1:",
             ("tests/test_resume_position.py",),
             "a loader that ends one batch short of its epoch is not stopped"),
    Mutation("torch-dropout-not-named", "toolkit/run/randomness.py",
             "if isinstance(module, RANK_DEPENDENT_DROPOUT) and module.p > 0:",
             "if type(module) is torch.nn.Dropout and module.p > 0:",
             ("tests/test_dropout_warning.py",),
             "Dropout2d and the other torch dropouts are not named at the start"),
    Mutation("checkpoint-cadence-off-by-one", "toolkit/loop/cadence.py",
             "return new_best or bool(checkpoint_every and global_step % checkpoint_every == 0)",
             "return new_best or bool(checkpoint_every and (global_step + 1) % checkpoint_every == 0)",
             ("tests/test_cadence.py",),
             "mid-epoch checkpoints land one step early"),
    Mutation("agreement-needs-two-ranks", "toolkit/loop/agreement.py",
             "return Agreement(*(bool(v > 0) for v in flags.tolist()))",
             "return Agreement(*(bool(v > 1) for v in flags.tolist()))",
             ("tests/test_cadence.py",),
             "a stop, a non-finite loss or a pre-emption seen by one rank of two is ignored"),
    Mutation("prune-spares-no-best", "toolkit/loop/keeper.py",
             "protect = {progress.best_step} if progress.best_step is not None else set()", "protect = set()",
             ("tests/test_cadence.py",),
             "pruning may delete the best checkpoint that load_best() needs"),
    Mutation("clip-every-micro-batch", "toolkit/run/optim.py",
             "if max_grad_norm and accelerator.sync_gradients:", "if max_grad_norm:",
             ("tests/test_optimizer_step.py",),
             "gradients clipped inside an accumulation window too"),
    # ---- the step's syncs and launches ----------------------------------------------------------------------
    Mutation("checkpoint-before-reading-the-loss", "toolkit/loop/training.py",
             "        self._catch_up()\n        now = time.perf_counter()", "        now = time.perf_counter()",
             ("tests/test_toolkit_api.py", "-k", "cadence"),
             "a checkpoint written before the unread losses are checked may hold a diverged step"),
    Mutation("duplicate-puzzle-ids-updated-apart", "toolkit/models/hrm.py",
             "    return torch.searchsorted(torch.sort(ids).values, ids)",
             "    return torch.arange(len(ids), device=ids.device)",
             ("tests/test_hrm_model.py",),
             "the sparse SignSGD sums no duplicate ids' gradients"),
    Mutation("recipe-check-after-sweep-precheck", "toolkit/run/config.py",
             "    if check is not None:\n        check(config)\n", "",
             ("tests/test_sweep.py", "-k", "recipe_check"),
             "a recipe's own check runs after the sweep's pre-check, so a bad grid value starts runs"),
    Mutation("missing-extra-names-no-command", "toolkit/process/extras.py",
             "which is not installed: pip install '{PACKAGE}[{extra}]'", "which is not installed",
             ("tests/test_extras.py",),
             "a missing extra does not say what to install"),
    # ---- data on the device, CUDA graphs -------------------------------------------------------------------
    Mutation("traffic-window-cut-one-step-late", "toolkit/data/traffic.py",
             "steps_out = torch.arange(INPUT_STEPS, INPUT_STEPS + OUTPUT_STEPS, device=device)",
             "steps_out = torch.arange(INPUT_STEPS + 1, INPUT_STEPS + OUTPUT_STEPS + 1, device=device)",
             ("tests/test_device_data.py",),
             "the traffic targets cut on the device are shifted by one timestep"),
    Mutation("hrm-augmentation-picked-apart-on-device", "recipes/hrm.py",
             "        return self.table_rows(order)", "        return order[..., 1] * self.copies",
             ("tests/test_device_data.py",),
             "the device path always takes a puzzle's first version, not the keyed augmentation"),
    Mutation("device-batches-rank-slice-ignored", "toolkit/run/device_data.py",
             "return order[:, self.rank * share:(self.rank + 1) * share]", "return order[:, :share]",
             ("tests/test_device_data.py",),
             "every rank cuts the first slice of the global batch"),
    Mutation("cuda-graph-losses-aliased", "toolkit/loop/losses.py",
             "self._micro.append(loss.clone() if self.copy else loss)", "self._micro.append(loss)",
             ("tests/test_cuda_graphs.py",),
             "a recorded loss is the graph's output, overwritten by its next replay"),
    Mutation("step-graph-keeps-a-stale-capture", "toolkit/run/step_graph.py",
             "        if self._graph is not None and signature != self._signature:", "        if False:",
             ("tests/test_step_graph.py",),
             "a captured step replays the learning rate it was captured with after the scheduler changed it"),
    Mutation("step-graph-captures-python-state", "toolkit/run/step_graph.py", "        if unsafe:", "        if False:",
             ("tests/test_step_graph.py",),
             "AdamATan2's Python step count is frozen into the graph: every replay repeats one bias correction"),
    Mutation("keyed-dropout-generator-not-reseeded", "toolkit/run/randomness.py",
             "        generator.manual_seed(keyed_hash_int(state.seed, 0xD509, state.key, state.calls))",
             "        pass", ("tests/test_step_graph.py", "tests/test_randomness.py"),
             "a reused generator continues its stream: masks depend on what ran before, not on the key"),
    Mutation("sasrec-negatives-keyed-on-a-python-epoch", "recipes/sasrec.py",
             "epoch=loop.device_epoch)", "epoch=loop.progress.epoch)",
             ("tests/test_step_graph.py",),
             "a captured SASRec step replays the negatives of the epoch it was captured in, every epoch after"),
    Mutation("dcrnn-coins-keyed-on-the-python-step", "recipes/dcrnn.py",
             'keyed_uniform(cfg.seed, TEACHER_COINS, batch["step"],',
             "keyed_uniform(cfg.seed, TEACHER_COINS, loop.global_step,",
             ("tests/test_step_graph.py",),
             "a captured DCRNN step replays the teacher-forcing coins of the step it was captured at"),
    Mutation("keyed-hash-folds-ints-differently", "toolkit/run/randomness.py",
             "    hashed = 0x9E3779B9  # a Python int", "    hashed = 0x9E3779B8  # a Python int",
             ("tests/test_randomness.py",),
             "Python-int keys folded on the host no longer give the tensor hash's values"),
    Mutation("rotary-swaps-halves-the-wrong-way", "toolkit/models/hrm.py",
             "return torch.cat([halves[..., 1:, :], halves[..., :1, :]], dim=-2).flatten(-3)",
             "return torch.cat([halves[..., :1, :], halves[..., 1:, :]], dim=-2).flatten(-3)",
             ("tests/test_hrm_model.py",),
             "the rotation along rows no longer swaps each head's halves: not the reference's rotate_half"),
    Mutation("heap-not-kept", "toolkit/process/heap.py",
             "        if user_choice() is None:", "        if user_choice() is not None:",
             ("tests/test_heap.py",),
             "glibc's thresholds never set: every step maps its large tensors afresh"),
    Mutation("start-run-forgets-the-heap", "toolkit/run/start.py",
             "    heap.keep_between_steps()  # freed memory", "    pass  # heap.keep_between_steps()  # freed memory",
             ("tests/test_heap.py",),
             "a run's process keeps glibc's default heap: its steps fault their memory back in"),
    Mutation("swiglu-without-gradient-takes-up-for-gate", "toolkit/kernels/hrm.py",
             "gate = F.silu(onednn.product(flat, weight[:width]), inplace=True)",
             "gate = F.silu(onednn.product(flat, weight[width:]), inplace=True)",
             ("tests/test_hrm_model.py",),
             "without gradient, SwiGLU's gate product takes the up half of the weight"),
    Mutation("rotary-tables-not-sliced-by-position", "toolkit/models/hrm.py",
             "return self.cos[:length, :width], self.signed_sin[:length, :width]",
             "return self.cos[-length:, :width], self.signed_sin[-length:, :width]",
             ("tests/test_hrm_model.py",),
             "q at the first position alone is rotated with the last position's angles"),
    Mutation("rms-norm-backward-forgets-the-mean", "toolkit/kernels/hrm.py",
             "return torch.sub(g, torch.mul(y, mean, out=work), out=work).mul_(r), None",
             "return torch.sub(g, y, out=work).mul_(r), None",
             ("tests/test_hrm_model.py",),
             "RMSNorm's written-out gradient drops mean(g y)"),
    Mutation("products-by-mkl-on-amd-too", "toolkit/kernels/onednn.py",
             'return vendor == "GenuineIntel" and capability == "AVX512" and not capped',
             'return capability == "AVX512" and not capped',
             ("tests/test_hrm_model.py::test_products_go_to_mkl_where_it_runs_avx512_kernels_and_to_onednn_elsewhere",),
             "the products go to MKL on AMD's CPUs, whose MKL runs AVX2 kernels"),
    Mutation("mkl-weight-gradient-reads-g-the-other-way-round", "toolkit/kernels/onednn.py",
             "        return torch.mm(g.t(), x)\n    narrower_x",
             "        return torch.mm(x.t(), g).t().contiguous()\n    narrower_x",
             ("tests/test_hrm_model.py", "-k", "linear_multiplies"),
             "MKL's weight gradient x.T g, whose values depend on g's layout", shows_here=mkl_runs_avx512_here),
    Mutation("kernels-proof-runs-the-plain-model-twice", "toolkit/kernels/__init__.py",
             "            _set_classes(model, swapped, 1)", "            _set_classes(model, swapped, 0)",
             ("tests/test_kernels.py", "-k", "not recipe"),
             "the proof compares the model's code with itself, and the model trains without its fast paths"),
    Mutation("kernels-proof-ignores-gradients", "toolkit/kernels/__init__.py",
             'refuse(f"gradient of its {key}", difference, p)',
             "pass  # gradients not compared",
             ("tests/test_kernels.py", "-k", "wrong_backward"),
             "a fast path whose backward differs from the model's trains: only the outputs are compared"),
    Mutation("sasrec-kernel-mask-offset-stays", "toolkit/kernels/sasrec.py",
             "                offset += rows * stop", "                offset += 0",
             ("tests/test_sasrec_kernels.py",),
             "the chunked attention reads every chunk's dropout mask from the first chunk's place"),
]


def checkout_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def copy_checkout(target: Path) -> None:
    for name in checkout_files():
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, destination)
    if (ROOT / ".cache").is_dir():  # prepared test data (MovieLens, generated puzzles) is shared, not copied
        (target / ".cache").symlink_to(ROOT / ".cache")


def apply(mutation: Mutation, copy: Path) -> bool:
    edits = ((mutation.path, mutation.old, mutation.new), *mutation.also)
    for relative, old, _new in edits:
        if (copy / relative).read_text().count(old) != 1:
            return False
    for relative, old, new in edits:
        path = copy / relative
        path.write_text(path.read_text().replace(old, new))
    return True


def run_one(mutation: Mutation, timeout: float, baseline: bool = False) -> tuple[str, float, str]:
    """(verdict, seconds, last lines of pytest's output). baseline: the same tests on the unchanged copy."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as scratch:
        copy = Path(scratch)
        copy_checkout(copy)
        # baseline: no bug; the tests must pass without it, or a CAUGHT means nothing
        if not baseline and not apply(mutation, copy):
            return "STALE", 0.0, f"{mutation.path}: the text to replace is not there exactly once"
        # The copy's toolkit, not the checkout's (an editable install points there): PYTHONPATH comes first.
        env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run([sys.executable, "-c", "import toolkit; print(toolkit.__file__)"], cwd=copy, env=env,
                               capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(copy)):
            return "ERROR", 0.0, f"the copy imports toolkit from {where or 'nowhere'}, not from {copy}"
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
        started = time.perf_counter()
        try:
            result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", time.perf_counter() - started, f"no verdict within {timeout:.0f} s"
        seconds = time.perf_counter() - started
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
        if baseline:
            return ("PASS" if result.returncode == 0 else "FAILS"), seconds, tail
        verdict = {0: "SURVIVED", 1: "CAUGHT"}.get(result.returncode, "ERROR")
        return verdict, seconds, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and the tests each one runs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation (default 600)")
    parser.add_argument("--verbose", action="store_true", help="print pytest's last lines for every mutation")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first pass: each test selection on the unchanged checkout must pass")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        print(f"error: --only {' '.join(unknown)}: no such mutation; one of: {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[name] for name in args.only] if args.only else MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}: {m.why}\n    tests: {' '.join(m.tests)}")
        return 0
    if not args.no_baseline:
        selections = {m.tests: m for m in chosen}
        print(f"baseline: {len(selections)} test selection(s) on the unchanged checkout", flush=True)
        failing = []
        for tests, m in selections.items():
            verdict, seconds, tail = run_one(m, args.timeout, baseline=True)
            print(f"{verdict:8} {seconds:6.1f} s  {' '.join(tests)}", flush=True)
            if verdict != "PASS":
                failing.append(tests)
                print("    " + tail.replace("\n", "\n    "), flush=True)
        if failing:
            print(f"error: {len(failing)} test selection(s) fail without any mutation; fix them first",
                  file=sys.stderr)
            return 1
    rows = []
    print(f"{len(chosen)} mutation(s), each in a fresh copy of {ROOT}", flush=True)
    for m in chosen:
        not_here = m.shows_here() if m.shows_here else None
        verdict, seconds, tail = ("NOT HERE", 0.0, not_here) if not_here else run_one(m, args.timeout)
        rows.append((m, verdict, seconds))
        print(f"{verdict:8} {seconds:6.1f} s  {m.name}" + (f" ({not_here})" if not_here else ""), flush=True)
        if args.verbose or verdict not in ("CAUGHT", "SURVIVED", "NOT HERE"):
            print("    " + tail.replace("\n", "\n    "), flush=True)
    print("\n| mutation | file | tests | result | seconds |\n| --- | --- | --- | --- | ---: |")
    for m, verdict, seconds in rows:
        print(f"| {m.name} | `{m.path}` | `{' '.join(m.tests)}` | {verdict} | {seconds:.1f} |")
    caught = sum(verdict == "CAUGHT" for _, verdict, _ in rows)
    shown = sum(verdict != "NOT HERE" for _, verdict, _ in rows)
    print(f"\n{caught} of {shown} caught" + (f" ({len(rows) - shown} not shown by this machine)" if shown < len(rows)
                                             else ""))
    return 0 if caught == shown else 1


if __name__ == "__main__":
    raise SystemExit(main())
