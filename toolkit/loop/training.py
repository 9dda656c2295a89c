"""The training loop written once, as a generator facade a recipe reads top to bottom:

    loop = TrainingLoop(run, model, train_loader, evaluate=validate, main_metric="val_ndcg", state={"ema": ema})
    loop.start()                                     # after accelerator.prepare(...): takes the run dir, resumes
    for epoch in loop.epochs():
        for batch in loop.batches():                 # may evaluate and checkpoint between steps (cadence)
            with accelerator.accumulate(model):
                loss, loss_value = ...; accelerator.backward(loss)
                loop.optimizer_step(optimizer, scheduler, loss=loss_value)   # clip, step, zero, record
        loop.end_epoch()                             # evaluates and checkpoints when due
    return loop.finish_at_best(run_test)             # best weights, test, summary.json, the run's end

This module is the iteration and the order of things (README, "How resume works"). The parts, each a module of its
own: progress, cadence, losses (read at a cadence), agreement, guards, evaluation, meter, keeper, summary (the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from toolkit.errors import TrainingStopped
from toolkit.loop.agreement import agree, any_rank_on_host
from toolkit.loop.cadence import epoch_end_save_due, evaluation_due, mid_epoch_save_due
from toolkit.loop.evaluation import Evaluations
from toolkit.loop.guards import stopped_without_saving
from toolkit.loop.keeper import CheckpointKeeper
from toolkit.loop.losses import StepLosses, read_and_count
from toolkit.loop.meter import StepMeter
from toolkit.loop.progress import Progress, require_whole_epoch, rest_of_epoch, total_training_steps
from toolkit.loop.restart import RestartUnderLoad
from toolkit.loop.summary import RunEnd
from toolkit.loop.trial import TrialReporter, probe_metric
from toolkit.process import preemption
from toolkit.run import compilation, randomness
from toolkit.run.distributed import mean_over_processes
from toolkit.run.optim import step_optimizer
from toolkit.run.randomness import reseed_global_rng, step_seed
from toolkit.run.start import Run
from toolkit.run.step_graph import StepGraph

__all__ = ["AFTER_STEP_HOOKS", "Progress", "TrainingLoop", "TrainingStopped", "rest_of_epoch", "require_whole_epoch"]


# hook(loop) after every optimizer step, once the loop has done its work for it: for tools and tests that act at an
# exact step (fault injection, counters, profilers). Append before the loop runs; the recipes never use it.
AFTER_STEP_HOOKS: list[Callable[[TrainingLoop], None]] = []


class TrainingLoop(RunEnd):
    def __init__(self, run: Run, model: torch.nn.Module, train_loader, *, evaluate, main_metric: str,
                 higher_is_better: bool = True, state: dict | None = None, rank_state: dict | None = None,
                 batches_per_epoch: Callable[[int], int] | None = None, row_columns: Callable[[], dict] | None = None):
        """evaluate(): validation metrics {name: number}, the same on every rank (gather_for_metrics). state /
        rank_state: {name: object with state_dict/load_state_dict} checkpointed once, or per rank (a carry).
        batches_per_epoch(epoch): for epochs of different lengths (CrossEpochBatchSampler); default len(loader).
        row_columns(): columns of the recipe's own in every metrics.csv row (HRM's latest full test)."""
        self.run, self.config, self.accelerator = run, run.config, run.accelerator
        self.model, self.train_loader, self.batches_per_epoch = model, train_loader, batches_per_epoch
        self.main_metric, self.higher_is_better = main_metric, higher_is_better
        self.rank_state = dict(rank_state or {})
        self.progress = Progress(run_id=run.run_id)
        self.stopped = False  # --max-steps reached or a stop requested: the epoch loop ends
        self._stop_request: str | None = None
        self._save_due = False  # an epoch end asked for a checkpoint (written after the epoch's body)
        self.losses = StepLosses(read_every=run.config.log_every, copy=run.config.cuda_graphs)  # read at a cadence
        self._rider = None
        self.keeper = CheckpointKeeper(run, model, dict(state or {}), self.rank_state)
        self.meter = StepMeter(self.accelerator.device, show_bar=run.is_main, say=run.print if run.is_main else None)
        self.evaluations = Evaluations(run, model, evaluate, main_metric, higher_is_better, self.meter)
        self.evaluations.row_columns = row_columns
        # A trial of `toolkit sweep --search` (TOOLKIT_TRIAL): each evaluation reports to the study, which may prune
        self.trial = TrialReporter.from_environment(run.is_main, main_metric, higher_is_better)
        self._run_started = self._wall_mark = time.perf_counter()  # this life; wall time not yet in progress
        self._compile_report = compilation.first_step_reporter(run)  # --compile: its cost, once a life
        self._mark_step = compilation.step_marker(run)  # --cuda-graphs: each micro-batch a new iteration of the graphs
        self.step_graph = StepGraph(run.whole_step_graphs, say=run.print)  # --cuda-graphs: run_step captures the step
        # The epoch as a tensor on the device, for what a captured step keys on it (SASRec's negatives): a Python int
        # would be baked into the graph at its capture
        self._device_epoch = torch.zeros((), dtype=torch.int64, device=self.accelerator.device)
        # Spinning OpenMP threads (an idle start) stall when other jobs arrive: the process restarts under PASSIVE
        self.restart_under_load = RestartUnderLoad(torch.get_num_threads(), self.accelerator.num_processes)
        if plain_dropout := randomness.rank_dependent_dropout_line(model):  # nn.Dropout: one line at the start
            run.print(plain_dropout)

    def start(self) -> None:
        """Take the run directory (lock, config.json, trackers), then load the resume checkpoint (if any) into the
        prepared objects, the extra state and the loop. Call after prepare()."""
        run = self.run
        # `sweep --search` checks its --metric against this recipe before a study starts (TOOLKIT_METRIC_PROBE):
        # here, once the recipe has defined everything its evaluate() calls, and before anything is written; exits
        evaluations = self.evaluations
        probe_metric(self.main_metric, self.higher_is_better, lambda: evaluations.measure(evaluations.evaluate_fn))
        self.keeper.refuse_another_world_size()  # before anything is written
        run.begin()
        saved = self.keeper.resume()
        if saved is not None:
            self.progress = where = Progress.from_saved(saved)
            run.print(f"resumed at epoch {where.epoch}, batch {where.batches_done}, step {where.global_step}")

    # ---- iteration ----------------------------------------------------------------------------------------
    def epochs(self):
        """Yield epoch numbers until --epochs, --max-steps or a stop request; then evaluate and save the end."""
        cfg, progress = self.config, self.progress
        if not self.run.begun:
            raise RuntimeError("call loop.start() before iterating loop.epochs()")
        preemption.catch_sigterm()  # a launcher's worker too, from here on (toolkit.process.preemption)
        self.meter.open_bar(self.total_steps, progress.global_step, self.run.recipe)
        past_max_steps = cfg.max_steps is not None and progress.global_step >= cfg.max_steps
        self.stopped = bool(progress.stop_reason) or past_max_steps  # resumed after a stop or at --max-steps
        while progress.epoch < cfg.epochs and not self.stopped:
            self._device_epoch.fill_(progress.epoch)
            yield progress.epoch
            if agree(self.accelerator, stop=self._stop_request is not None).stop and not self.stopped:
                self._take_stop_request()
            if self._save_due:
                self.save()
                self._save_due = False
        if progress.last_eval_step != progress.global_step:
            self._validate(scheduled=self._evaluation_due())
        self.save()
        randomness.end_micro_batches()

    def batches(self):
        """Yield this epoch's micro-batches, continuing mid-epoch after a resume; stops at --max-steps."""
        accelerator, progress, cfg, loader = self.accelerator, self.progress, self.config, self.train_loader
        loader.set_epoch(progress.epoch)  # the sampler's order is a function of (data seed, epoch)
        iterator = iter(rest_of_epoch(accelerator, loader, progress.batches_done))
        accelerator.step = 0  # Accelerate's accumulation counter: windows restart with the epoch, also on resume
        self.meter.begin_epoch()
        while True:
            fetch_start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                require_whole_epoch(progress.batches_done, len(loader), progress.epoch)
                return
            compute_start = time.perf_counter()
            self.meter.fetched(compute_start - fetch_start)
            key = progress.epoch * 1_000_003 + progress.batches_done
            reseed_global_rng(step_seed(cfg.seed, key, accelerator.process_index))
            randomness.begin_micro_batch(cfg.seed, key, accelerator.process_index, accelerator.num_processes)
            if self._mark_step is not None:
                self._mark_step()
            yield batch
            progress.batches_done += 1
            progress.samples_seen += cfg.batch_size
            self.meter.computed(cfg.batch_size, time.perf_counter() - compute_start)
            if accelerator.sync_gradients:
                progress.global_step += 1
                self._after_optimizer_step(end_of_epoch=progress.batches_done >= len(loader))
                for hook in AFTER_STEP_HOOKS:
                    hook(self)
            if self.stopped:
                return

    def optimizer_step(self, optimizer, scheduler=None, *, loss: torch.Tensor | None = None,
                       rank_loss: torch.Tensor | None = None) -> None:
        """The step every recipe takes, inside `with accelerator.accumulate(model):` after `accelerator.backward(...)`:
        clip to --max-grad-norm when the gradients sync, step the optimizer and the scheduler (Accelerate skips both
        inside an accumulation window), zero the gradients, record the micro-batch's loss. `optimizer` may be a list
        (HRM's AdamATan2 and its sparse embedding's SignSGD): each steps in turn, then the scheduler, then each is
        zeroed. Give `loss`, the mean over the GLOBAL batch (global_mean returns it), or `rank_loss`, this rank's mean
        over its equal share."""
        if (loss is None) == (rank_loss is None):
            raise TypeError("optimizer_step: give exactly one of loss= (the global batch's mean) or rank_loss=")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        graph = self.step_graph
        for each in optimizers:
            graph.saw_optimizer(each)
        # Captured (--cuda-graphs): the scheduler's step is host work (a new learning rate), after each replay
        step_optimizer(self.accelerator, self.model, self.config.max_grad_norm, optimizers,
                       None if graph.capturing else scheduler)
        if graph.capturing and scheduler is not None:
            graph.defer(scheduler.step)
        self.record_loss(loss if rank_loss is None else mean_over_processes(self.accelerator, rank_loss.detach()))

    @property
    def global_step(self) -> int:
        """Optimizer steps made so far (in a batch's body before its optimizer_step: the steps before this one)."""
        return self.progress.global_step

    @property
    def device_epoch(self) -> torch.Tensor:
        """The epoch as a 0-d tensor on the device, filled at each epoch's start: what a captured step (--cuda-graphs)
        keys on, where a Python int would be baked into the graph at its capture (SASRec's negatives)."""
        return self._device_epoch

    @property
    def best_step(self) -> int | None:
        """The step of the best validation so far (--main-metric), None before the first evaluation."""
        return self.progress.best_step

    def evaluate_now(self, function: Callable[[], dict], step: int) -> dict:
        """A recipe's own evaluation at a cadence of its own, in a training step's body after its optimizer_step
        (HRM's whole test split every --eval-full-test-every steps): function()'s metrics (eval mode, no_grad, then
        train mode again), a non-finite one refused, shown and logged at `step`, its time left out of the training's."""
        return self.evaluations.between_steps(function, step, self.progress)

    def run_step(self, step: Callable[[dict], None], batch: dict) -> None:
        """step(batch): the recipe's training step (forward, backward, optimizer_step). Called as is; under
        --cuda-graphs, captured once as one CUDA graph and replayed (toolkit.run.step_graph), where it must key anything
        that changes between steps on tensors (the batch, device_epoch), not on Python values."""
        self.step_graph.run(step, batch)

    def record_loss(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss, already the mean over the whole GLOBAL batch (the same value on every rank): a
        rank's own mean must be averaged first (toolkit.run.distributed.mean_over_processes), or use optimizer_step's
        rank_loss=, which does it. For a step that optimizer_step does not fit (HRM's two optimizers)."""
        if self.step_graph.capturing:  # the graph's loss, copied after each replay (the next one overwrites it)
            static = loss.detach()
            self.step_graph.defer(lambda: self.losses.record(static))
        else:
            self.losses.record(loss)

    def read_with_loss(self, provide, consume) -> None:
        """A recipe's own device values (e.g. training sums to log) read in the loss's copy, every --log-every steps:
        provide() -> a tensor or None (nothing to read), consume(values: list[float]) with its values."""
        self._rider = (provide, consume)

    def request_stop(self, reason: str) -> None:
        """End the run early (e.g. early stopping): at the next step boundary or epoch end every rank stops, the
        final step is evaluated and checkpointed, and `reason` goes into summary.json."""
        self._stop_request = reason

    def _take_stop_request(self) -> None:
        self.progress.stop_reason = self._stop_request or "stop requested on another rank"
        self.stopped = True
        self.run.print(f"stopping at step {self.progress.global_step}: {self.progress.stop_reason}")

    def _after_optimizer_step(self, end_of_epoch: bool) -> None:
        """Close the step's losses. At the read cadence (--log-every; at once when any rank has a signal or a stop
        pending) or at the last step: read them (guards, bar, log) and agree with the other ranks (pre-empted,
        diverged, a stop). Then the mid-epoch evaluation and checkpoint when due, each reading first (an epoch end or
        the loop's end does those itself)."""
        cfg, progress = self.config, self.progress
        step = progress.global_step
        self.losses.close_step(step, progress.epoch)
        # --compile: the first step's compute, said once (toolkit/run/compilation.py)
        if self._compile_report is not None:
            self._compile_report = self._compile_report(self.meter.timer.compute_sec)
        if cfg.max_steps is not None and step >= cfg.max_steps:
            self.stopped = True
        if self.losses.read_due(step) or self.stopped or self._signal_or_stop_anywhere():
            rider = self._rider if self.losses.read_due(step) else None
            problem = read_and_count(self.losses, progress, self.meter, self.accelerator, cfg, rider)
            agreed = agree(self.accelerator, preempted=preemption.requested(), diverged=problem is not None,
                           stop=self._stop_request is not None, terminated=preemption.terminated())
            if agreed.diverged:
                self._stop_without_saving(problem or f"the training loss went bad on another rank by step {step}")
            if agreed.preempted:
                self._evaluate_before_leaving(end_of_epoch)
                self._checkpoint_requeue_and_exit(requeue=not agreed.terminated)
            if agreed.stop:
                self._take_stop_request()
        # After the pre-emption and stop above (one process reads them at every step), which the restart would lose
        if not self.stopped and (load := self.restart_under_load.arrived()):
            self._evaluate_before_leaving(end_of_epoch)
            self.save()
            self.meter.close_bar()
            self.restart_under_load.leave(self.run, self.progress.global_step, load)
        if self.stopped or end_of_epoch:
            return  # the epoch end / the loop's end evaluates and saves this step
        new_best = False
        if self._evaluate_mid_epoch():
            if self.stopped:
                return  # the loop's end saves this step, with the stop reason in it
            new_best = progress.best_step == step  # mid-epoch: load_best() needs its checkpoint
        if mid_epoch_save_due(cfg.checkpoint_every, step, new_best):
            self.save()

    def _evaluate_before_leaving(self, end_of_epoch: bool) -> None:
        """A pre-emption (or a restart) at a step with a scheduled mid-epoch evaluation evaluates first: the resumed
        life starts after this step, so its evaluation (the metrics.csv row, the best step, an early stop) was lost
        and the next row averaged the losses of both rows' steps. An epoch end's or the loop end's evaluation is the
        resumed life's own (it finds that epoch or run not closed)."""
        if not (end_of_epoch or self.stopped):
            self._evaluate_mid_epoch()

    def _evaluate_mid_epoch(self) -> bool:
        """The evaluation scheduled at this step by --eval-every-steps, if due, and a stop it asks for (early
        stopping) agreed by every rank. True when it evaluated."""
        if not (self.config.eval_every_steps and self._evaluation_due()):
            return False
        self._validate()
        if agree(self.accelerator, stop=self._stop_request is not None).stop:
            self._take_stop_request()
        return True

    def _signal_or_stop_anywhere(self) -> bool:
        """Between read cadences: has any rank been signalled or asked to stop? Then the losses are read and the
        ranks agree at THIS step, so a pre-emption is saved at the next optimizer step, not at the next --log-every
        one (which can overrun a launcher's or scheduler's kill). N processes all-reduce one flag on the host every
        step (no device sync; benchmarks/README.md measures what it costs)."""
        return any(any_rank_on_host(self.accelerator, preemption.requested() or self._stop_request is not None))

    def _checkpoint_requeue_and_exit(self, requeue: bool) -> None:
        """Pre-empted (SIGUSR1, SIGTERM): a complete checkpoint of this step, requeue (main process; not after a
        SIGTERM), every rank exits 0."""
        self.save()
        self.meter.close_bar()
        preemption.requeue_and_exit(self.run, self.progress.global_step, self.config.max_requeues, requeue)

    def _stop_without_saving(self, what: str) -> None:
        self.meter.close_bar()
        raise stopped_without_saving(what, self.run.output_dir, self.progress.best_step)

    # ---- epoch end: evaluate, record, checkpoint ----------------------------------------------------------
    def end_epoch(self) -> dict | None:
        """Close the epoch: evaluate when due (--eval-every epochs, or --eval-every-steps; always at the last
        epoch) and mark a checkpoint due; it is written when the epoch's body is over, so a stop requested after
        this evaluation is in it. Returns the metrics when it evaluated. Stopped mid-epoch: the loop's end does it."""
        cfg, progress = self.config, self.progress
        if progress.batches_done < len(self.train_loader):
            return None
        progress.epoch += 1
        progress.batches_done = 0
        last = self.stopped or progress.epoch >= cfg.epochs
        due = self._evaluation_due()
        metrics = self._validate(scheduled=due) if due or last else None
        new_best = metrics is not None and progress.best_step == progress.global_step
        self._save_due = epoch_end_save_due(cfg.checkpoint_every, progress.global_step, new_best, last)
        return metrics

    def _validate(self, scheduled: bool = True) -> dict:
        """Evaluate and write the metrics row, once the row's training losses are read."""
        self._catch_up()
        metrics = self.evaluations.validate(self.progress, scheduled=scheduled)
        if self.trial is not None and (pruned := self.trial.report(metrics, self.progress.global_step)):
            self.request_stop(pruned)  # agreed by every rank at this step, as any stop request
        return metrics

    def _catch_up(self) -> None:
        """Read the losses not read yet (before an evaluation or a checkpoint): a bad one stops the run here, on every
        rank (each read the same global losses), and no checkpoint is written."""
        problem = read_and_count(self.losses, self.progress, self.meter, self.accelerator, self.config)
        if problem is not None:
            self._stop_without_saving(problem)

    def _evaluation_due(self) -> bool:
        cfg, progress = self.config, self.progress
        return evaluation_due(cfg.eval_every_steps, cfg.eval_every, progress.global_step, progress.epoch,
                              progress.batches_done)

    def save(self) -> None:
        """A complete checkpoint of the current position (collective), once per step; never of a diverged one."""
        if self.keeper.saved(self.progress.global_step):
            return
        self._catch_up()
        now = time.perf_counter()
        self.progress.wall_time_sec += now - self._wall_mark
        self._wall_mark = now
        self.keeper.save(self.progress)

    @property
    def total_steps(self) -> int:
        return total_training_steps(self.config, self.batches_per_epoch or len(self.train_loader))
