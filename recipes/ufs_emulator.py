"""UFS sea-ice emulator: an MLP from the local ocean/atmosphere state (14 fields) to ice concentration (aice).

Runs unchanged on one CPU process with many threads (seed 000's CPU-node mode), several CPU processes (gloo, seed
001), GPUs and several nodes:

    python -m toolkit.data.ufs synth --out data/gdas-like.nc            # a file with a known noise floor sigma
    python recipes/ufs_emulator.py --data data/gdas-like.nc --threads 2
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/ufs_emulator.py --data data/gdas-like.nc
    sbatch slurm/multinode_cpu.sbatch recipes/ufs_emulator.py --preset gdas --data /path/to/gdas.ice.t00z.inst.f009.nc
    python recipes/ufs_emulator.py --data ocean.nc --data-atmos atmos.nc --mask-variable umask --hemisphere north
    python -m toolkit.export aoti runs/ufs_emulator/<run> --out emulator.pt2    # for C++ (export/cpp/)
    python recipes/ufs_emulator.py --preset soca --data gdas.t00z.icef003.nc --hemisphere south   # SOCA's IceNet
    python -m toolkit.export torchscript runs/ufs_emulator/<run> --out soca/antarctic.pt --format soca

Presets (--preset; any flag overrides the preset's value): `cpu` (the default: 300 epochs, early stopping after 20
evaluations without improvement; minutes on a laptop CPU for the generated file, NOT the teams' training length;
3 x 64 GELU, Adam lr 1e-4, weight decay 1e-4), `gdas` (aibalance c710abb's settings for GDAS CICE files: 3 x 64
ReLU as its ufsemulator/model.py, 100,000 epochs, a patience of 50 that is only reported, never stopping before 3,000
epochs, its domain --domain aibalance-c710abb and the first 400,000 cells) and `soca` (the network SOCA's MLBalance
runs, JCSDA soca MLJac.h with IceNet.h: --architecture icenet, fc1 -> fc2 -> sigmoid with no activation between and
no output statistics, aice trained directly; SOCA's seven inputs in MLJac's order tair tsfc sst sss hs hi sice; its
domain --domain soca, one model per pole, --hemisphere north (give south for the other), at most 400,000 patterns per
process as IceEmul.h prepData; Adam lr 1e-3 without weight decay as BaseEmul.h's train; 300 epochs as `cpu`). All:
batch 1000 (GLOBAL: split over the processes; with --batch-per-process 1000 keeps seed 000's 1000 per process).

Features: inputs and outputs chosen by our variable names (default: sst sss tair tsfc hi hs sice uocn vocn uatm vatm
qref flwdn fswdn -> aice), found in the file(s) under an explicit name (--variables NAME=VAR), ours, the CICE history
name (sst_h, Tair_h, Qref_h, aice_h, ...) or a CF standard name, reported in one line (`variables: sst<-sst_h, ...`);
the inputs may come from two files on one grid (--data ocean/ice, --data-atmos atmosphere; aibalance's CF pair on a
Gaussian grid read at the surface level); patterns are the cells of the sea-ice domain (ocean mask tmask or umask
with their latitudes TLAT or ULAT, or --mask thickness-tair, |latitude| >= --min-abs-lat in --hemisphere north,
south or both, open water in or out: --no-open-water keeps aice > 0 only; or a team's own, --domain soca,
aibalance-c710abb or aibalance-b1eccbc), thinned (--thin),
capped (--max-patterns, --max-patterns-per-rank) and split into training and validation (--val-fraction) by keyed
coins per cell; each rank reads its own strided share of the patterns (seed 001) and the per-feature mean/std of
inputs and outputs are merged over the ranks as (count, mean, M2) in float64, stored IN the model as buffers (a std
below 1e-6 becomes 1); the network trains in normalised space with MSE; validation reports RMSE and MAE in physical
units, R^2, for generated files RMSE / the noise floor sigma, and the emulator's Jacobian as the mean |d aice / d x|
per input in physical units (`val_jac_abs_mean/<input>`: what data assimilation uses of the model) and its mean
Frobenius norm in normalised units (`val_jacobian_frobenius`); --activation between the layers (gelu, relu,
identity); --output-activation sigmoid bounds the outputs to (0, 1) as SOCA's IceNet does (default none);
--architecture icenet is SOCA's IceNet (outputs not normalised: the loss is the MSE of aice itself); early stopping
on the validation loss (--patience, --min-epochs, or only reported with --no-stop-early); the best weights give the
final validation metrics and a predicted-vs-true scatter (val_scatter.png).

Errors (one line, exit 2, before anything is written): no --data, a missing or unreadable file, a missing variable
(with the names tried), two files on different grids, an all-masked domain, NaNs inside the domain (with their
count), out-of-range numbers, a batch larger than the training patterns, and everything the shared flags refuse.
"""

from __future__ import annotations

from toolkit.process import begin_process  # noqa: I001

begin_process()  # first, before anything heavy: SIGUSR1 (pre-emption) only sets a flag from here on; OpenMP's policy

# isort: split
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from toolkit import (
    EarlyStopping,
    Run,
    TrainConfig,
    TrainingLoop,
    UsageError,
    device_batches,
    error_metrics,
    format_table,
    make_optimizer,
    masked_error_sums,
    model_line,
    one_line_errors,
    parse_config,
    require_at_least,
    require_batch_fits,
    require_finite,
    require_range,
    shuffled_batches,
    start_run,
)
from toolkit.data.ufs import (
    AUTO,
    DEFAULT_INPUTS,
    DEFAULT_OUTPUTS,
    PatternRows,
    UfsPatterns,
    check_zeroed,
    describe_layout,
    describe_variables,
    load_patterns,
    whole_batch,
)
from toolkit.data.ufs_domains import check_domain, zeroed_inputs
from toolkit.models.ufs_emulator import ICENET_INPUTS, UfsEmulator
from toolkit.process import extras


@dataclass
class UfsConfig(TrainConfig):
    """The sea-ice emulator; the defaults are the `cpu` preset's (PRESETS below)."""

    # Flags added after runs were made: a run whose config.json lacks one resumes with this value (not a flag)
    added_flags = {"output_activation": "none", "domain": "toolkit", "mask": "variable", "activation": "gelu",
                   "architecture": "mlp"}

    data: Path | None = None
    """CICE/MOM6-style netCDF file (python -m toolkit.data.ufs synth --out FILE writes a generated one); with
    --data-atmos, the ocean/ice file."""
    data_atmos: Path | None = None
    """A second netCDF file on the same grid holding (some of) the inputs, e.g. the atmosphere's."""
    inputs: tuple[str, ...] = DEFAULT_INPUTS
    """Input variables, by our names (each found under --variables, ours, the CICE history name or a CF name)."""
    outputs: tuple[str, ...] = DEFAULT_OUTPUTS
    """Output variables, by our names."""
    variables: tuple[str, ...] = ()
    """Names in the file(s) for some of --inputs/--outputs, as NAME=VARIABLE (e.g. sst=SST tair=T2m); the others are
    looked up as ours, CICE's (sst_h, Tair_h, Qref_h, aice_h, ...), then CF standard names."""
    domain: Literal["toolkit", "soca", "soca-unclean", "aibalance-c710abb", "aibalance-b1eccbc"] = "toolkit"
    """Which cells are patterns, selected as whose code selects them: toolkit (ours: --mask, --mask-variable, the
    flags --min-abs-lat, --hemisphere, --no-open-water; a keyed random subset when capped); soca (JCSDA SOCA
    IceEmul.h, one model per pole: umask == 1, ULAT > 40 in --hemisphere north or south, 0 < aice <= 1, each rank's
    first --max-patterns-per-rank of its stride); soca-unclean (SOCA's selectData with clean data: false: ULAT > 60
    north or < -60 south, no mask, no ice condition, land cells too; one model per pole, SOCA's per-rank cap);
    aibalance-c710abb (umask == 1, aice >= 0, the first N cells of
    the flag --max-patterns in grid order: the gdas preset's); aibalance-b1eccbc (aibalance HEAD on its CF files:
    the thickness-tair mask, aice > 0, the first N cells of the flag --max-patterns in grid order; sice, uocn, vocn,
    flwdn and fswdn are 0 in every pattern, as its reader gives them). A team's domain
    refuses the flags whose choice it fixes."""
    mask: Literal["variable", "thickness-tair"] = "variable"
    """The ocean, for --domain toolkit: variable (--mask-variable's cells > 0.5) or thickness-tair (aibalance's CF
    files: 0 < sea_water_cell_thickness <= 500 m at the surface level and 183.15 <= tair <= 333.15 K)."""
    mask_variable: str = AUTO
    """Ocean mask variable (cells > 0.5 are ocean; a team's domain: == 1): auto = tmask, else umask (soca and
    aibalance-c710abb: umask); "" = every cell."""
    lat_variable: str = AUTO
    """Latitude variable (degrees) for --min-abs-lat and --hemisphere: auto = the mask's (TLAT for tmask, ULAT for
    umask), else TLAT, ULAT, lat, latitude or a standard_name latitude."""
    min_abs_lat: float = 40.0
    """The sea-ice domain: cells with |latitude| >= this (0 = every latitude)."""
    hemisphere: Literal["both", "north", "south"] = "both"
    """The sea-ice domain: poleward of --min-abs-lat in this hemisphere, or both."""
    open_water: bool = True
    """Keep open-water cells (aice = 0) in the domain; --no-open-water keeps aice > 0 only."""
    thin: int = 1
    """Keep every N-th domain cell."""
    max_patterns: int = 0
    """At most this many patterns (a keyed random subset; with an aibalance domain the first N in grid order; 0 =
    all)."""
    max_patterns_per_rank: int = 0
    """At most this many patterns per process: the cap is N x the process count (a keyed random subset, the same as
    --max-patterns N x processes; with --domain soca each rank's first N of its stride, as SOCA; 0 = none)."""
    val_fraction: float = 0.1
    """Share of the patterns held out for validation (a keyed coin per cell)."""
    range_factor: float = 1.0
    """Widen the plausible range of each field (by its units: K 150..350, psu 0..60, m 0..50, m/s -150..150, kg/kg
    0..0.1, W/m^2 -100..2000; aice -0.25..1.25) by this factor around its centre; 0 turns the check off."""
    architecture: Literal["mlp", "icenet"] = "mlp"
    """mlp: --layers hidden layers of --hidden with --activation between, outputs normalised by their statistics
    (trained in normalised units); icenet: SOCA's IceNet (IceNet.h, what MLJac.h runs): fc1 -> fc2 -> sigmoid, one
    hidden layer of --hidden, no activation between, no output statistics (the output and the loss are aice itself);
    it needs --layers 1 --activation identity --output-activation sigmoid, which --preset soca sets."""
    hidden: int = 64
    """Width of each hidden layer."""
    layers: int = 3
    """Hidden layers."""
    activation: Literal["gelu", "relu", "identity"] = "gelu"
    """Between the layers: gelu (the reference's), relu (aibalance c710abb's) or identity (none: SOCA's IceNet)."""
    output_activation: Literal["none", "sigmoid"] = "none"
    """On the network's output: none, or sigmoid (outputs bounded to (0, 1), as SOCA's IceNet; for aice)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Adam (the reference) or plain SGD."""
    weight_decay: float = 1e-4
    """L2 weight decay."""
    patience: int = 20
    """Stop when the validation loss has not improved by --min-delta for this many evaluations (0 = never)."""
    min_delta: float = 0.0
    """Improvement of the validation loss that resets the patience."""
    stop_early: bool = True
    """Stop when the patience runs out; --no-stop-early only reports it (one line), as the teams' training does."""
    min_epochs: int = 0
    """Never stop early before this many epochs."""
    # Shared flags: a CPU-sized length (not the teams': see the gdas preset); the reference's batch and learning rate.
    epochs: int = 300
    batch_size: int = 1000
    lr: float = 1e-4

    captures_whole_step = True  # its step runs through loop.run_step (--cuda-graphs: one CUDA graph)


# --preset NAME (toolkit.run.presets): the first is the default; any flag given overrides the preset's value.
PRESETS = {
    "cpu": ("300 epochs, patience 20: minutes on a laptop CPU for the generated file, NOT the teams' length",
            UfsConfig()),
    "gdas": (
        "the teams' training on GDAS CICE files as aibalance c710abb (seed 000's) runs it: 3 x 64 ReLU, 100,000 "
        "epochs, patience 50 only reported, at least 3,000 epochs; its domain (--domain aibalance-c710abb: umask == "
        "1, aice >= 0) and its cap, the first 400,000 cells in grid order",
        UfsConfig(epochs=100_000, patience=50, stop_early=False, min_epochs=3_000, domain="aibalance-c710abb",
                  max_patterns=400_000, activation="relu"),
    ),
    "soca": (
        "the network SOCA's MLBalance runs (MLJac.h, IceNet.h): fc1 -> fc2 -> sigmoid, no activation between, no "
        "output statistics; SOCA's inputs in its order, tair tsfc sst sss hs hi sice; its domain (--domain soca, "
        "one model per pole: --hemisphere north, or south) and cap (400,000 per process); Adam lr 1e-3, no weight "
        "decay (BaseEmul.h); 300 epochs, patience 20. Export: torchscript --format soca",
        UfsConfig(architecture="icenet", layers=1, activation="identity", output_activation="sigmoid",
                  inputs=ICENET_INPUTS, domain="soca", hemisphere="north", max_patterns_per_rank=400_000, lr=1e-3,
                  weight_decay=0.0),
    ),
}

ACTIVATION_NAMES = {"gelu": "GELU", "relu": "ReLU", "identity": "linear"}
ICENET = {"layers": 1, "activation": "identity", "output_activation": "sigmoid"}  # what --architecture icenet is


def variable_names(cfg: UfsConfig) -> dict[str, str]:
    """--variables NAME=VARIABLE as {our name: name in the file} (one error line for a malformed or unknown one)."""
    names: dict[str, str] = {}
    for item in cfg.variables:
        name, equals, variable = item.partition("=")
        if not equals or not name or not variable:
            raise UsageError(f"--variables {item} is invalid; give NAME=VARIABLE pairs, e.g. sst=SST tair=T2m")
        if name not in (*cfg.inputs, *cfg.outputs):
            raise UsageError(f"--variables {item}: {name!r} is not one of --inputs/--outputs "
                             f"({' '.join((*cfg.inputs, *cfg.outputs))})")
        if name in names:
            raise UsageError(f"--variables names {name!r} twice ({name}={names[name]}, {item}); give it once")
        names[name] = variable
    return names


def check(cfg: UfsConfig) -> None:
    """Recipe-specific checks, before anything is built or read."""
    if cfg.data is None:
        raise UsageError(
            "--data is required: a CICE/MOM6-style netCDF file (python -m toolkit.data.ufs synth "
            "--out data/gdas-like.nc writes a generated one)"
        )
    if cfg.data_atmos is not None and cfg.data_atmos.expanduser().resolve() == cfg.data.expanduser().resolve():
        raise UsageError(f"--data-atmos {cfg.data_atmos} is the --data file; give the atmosphere file, or leave "
                         "--data-atmos out when one file holds every variable")
    require_at_least(cfg, 1, "thin", "hidden", "layers")
    if cfg.architecture == "icenet" and any(getattr(cfg, key) != value for key, value in ICENET.items()):
        given = " ".join(f"--{key.replace('_', '-')} {getattr(cfg, key)}" for key in ICENET)
        needed = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in ICENET.items())
        raise UsageError(f"--architecture icenet is SOCA's IceNet, fc1 -> fc2 -> sigmoid: it needs {needed} (given "
                         f"{given}); --preset soca sets them, or give --architecture mlp")
    require_at_least(cfg, 0, "max_patterns", "max_patterns_per_rank", "patience", "min_epochs")
    check_domain(cfg.domain, mask=cfg.mask, mask_variable=cfg.mask_variable, lat_variable=cfg.lat_variable,
                 min_abs_lat=cfg.min_abs_lat, hemisphere=cfg.hemisphere, open_water=cfg.open_water,
                 max_patterns=cfg.max_patterns, max_patterns_per_rank=cfg.max_patterns_per_rank)
    check_zeroed(cfg.domain, zeroed_inputs(cfg.domain, cfg.inputs), zeroed_inputs(cfg.domain, cfg.outputs),
                 variable_names(cfg))
    require_range(cfg, "(0, 1)", "val_fraction")
    if not (cfg.range_factor == 0 or (cfg.range_factor >= 1 and math.isfinite(cfg.range_factor))):
        raise UsageError(f"--range-factor {cfg.range_factor} is invalid; give a factor >= 1, or 0 for no check")
    if not 0 <= cfg.min_abs_lat <= 90:
        raise UsageError(f"--min-abs-lat {cfg.min_abs_lat} is invalid; give degrees in [0, 90]")
    require_finite(cfg, "weight_decay", "min_delta")
    for flag, names in (("--inputs", cfg.inputs), ("--outputs", cfg.outputs)):
        if not names or len(set(names)) != len(names):
            raise UsageError(f"{flag} {' '.join(names)} is invalid; give one or more distinct variable names")
    if set(cfg.inputs) & set(cfg.outputs):
        raise UsageError(f"{sorted(set(cfg.inputs) & set(cfg.outputs))[0]} is in both --inputs and --outputs")
    variable_names(cfg)


def plot_predicted_vs_true(path: Path, predicted: torch.Tensor, true: torch.Tensor, names, units, title: str):
    plt = extras.pyplot()

    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4.2), squeeze=False)
    for k, (ax, name) in enumerate(zip(axes[0], names, strict=True)):
        x, y = true[:, k].numpy(), predicted[:, k].numpy()
        ax.scatter(x, y, s=2, alpha=0.3)
        low, high = min(x.min(), y.min()), max(x.max(), y.max())
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        ax.set(xlabel=f"true {name} [{units.get(name, '')}]", ylabel=f"predicted {name}", title=title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def training_rows(model: UfsEmulator, patterns: UfsPatterns) -> dict[str, torch.Tensor]:
    """The training patterns as the network sees them: inputs and targets normalised by the training statistics."""
    return {"x": model.normalise_inputs(patterns.train_inputs), "y": model.normalise_outputs(patterns.train_targets)}


def normalised_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The objective trained on: MSE in normalised space, so every output counts in units of its training std."""
    return F.mse_loss(out.float(), target)  # equal per-rank batches: the mean of means is global


@one_line_errors
def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(PRESETS, argv, description=__doc__, check=check)
    with start_run(cfg, recipe="ufs_emulator") as run:
        return train(run, cfg)


def train(run: Run, cfg: UfsConfig) -> dict:
    accelerator = run.accelerator

    # ---- data: each rank reads its strided share; statistics merged over ranks; patterns assembled in order ----
    patterns = load_patterns(
        accelerator,
        cfg.data,
        inputs=cfg.inputs,
        outputs=cfg.outputs,
        mask_variable=cfg.mask_variable,
        lat_variable=cfg.lat_variable,
        min_abs_lat=cfg.min_abs_lat,
        thin=cfg.thin,
        max_patterns=cfg.max_patterns,
        val_fraction=cfg.val_fraction,
        seed=cfg.seed,
        range_factor=cfg.range_factor,
        atmos_path=cfg.data_atmos,
        variables=variable_names(cfg),
        hemisphere=cfg.hemisphere,
        open_water=cfg.open_water,
        max_patterns_per_rank=cfg.max_patterns_per_rank,
        domain=cfg.domain,
        mask=cfg.mask,
    )
    meta = patterns.meta
    require_batch_fits(cfg.batch_size, meta["train_patterns"], f"training patterns of {cfg.data}")
    sigma = meta["attributes"].get("noise_sigma")  # generated files: the noise floor of the (single) output
    run.describe_data(
        patterns.fingerprint,  # both files' content, and the subset when a cap per process cut it
        path=str(cfg.data),
        atmos_path=None if cfg.data_atmos is None else str(cfg.data_atmos),
        variables=meta["variables"],
        mask_variable=meta["mask_variable"],
        lat_variable=meta["lat_variable"],
        where=meta["where"],  # the domain's cells in words
        patterns=meta["patterns"],
        train=meta["train_patterns"],
        valid=meta["valid_patterns"],
        grid=meta["grid"],
        units=meta["units"],
        noise_sigma=sigma,
    )
    run.print(describe_variables(meta))
    for line in describe_layout(meta):  # levels read, cells matched by coordinate value, the domain's rule
        run.print(line)
    run.print(
        f"data: {meta['patterns']} patterns of {meta['domain_cells']} domain cells on a {meta['grid']} grid "
        f"({meta['train_patterns']} training, {meta['valid_patterns']} validation)"
    )

    # ---- model: the statistics are its buffers; it trains on normalised patterns -------------------------------
    # IceNet has no output statistics: mean 0 and std 1 make the outputs' normalisation the identity (aice trained)
    icenet = cfg.architecture == "icenet"
    model = UfsEmulator(
        patterns.input_mean,
        patterns.input_std,
        torch.zeros_like(patterns.output_mean) if icenet else patterns.output_mean,
        torch.ones_like(patterns.output_std) if icenet else patterns.output_std,
        hidden=cfg.hidden,
        layers=cfg.layers,
        output_activation=cfg.output_activation,
        activation=cfg.activation,
    )
    train_set = PatternRows(training_rows(model, patterns), index_name="pattern")
    valid_set = PatternRows(
        {
            "x": model.normalise_inputs(patterns.valid_inputs),
            "x_physical": patterns.valid_inputs,  # the Jacobian's point, in the file's units (float64)
            "y_true": patterns.valid_targets,
        },
        index_name="pattern",
    )
    valid_variance = patterns.valid_targets.var(dim=0, unbiased=False)  # for R^2 (float64, the whole split)
    loader_args = dict(batch_size=cfg.batch_size, num_workers=cfg.num_workers, collate_fn=whole_batch)
    # Full global batches only (N processes and one process take identical steps), cut from a keyed permutation of
    # each epoch a whole batch at a time: at ~1 ms a step, a sampler yielding item by item would cost ~10%.
    batches = shuffled_batches(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs)
    # On the device, cut there per rank (toolkit.run.device_data); a set too large for the GPU goes through a
    # DataLoader.
    train_loader = device_batches(run, train_set, batches, num_workers=cfg.num_workers, collate_fn=whole_batch)
    valid_loader = DataLoader(valid_set, shuffle=False, **loader_args)
    optimizer = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer, valid_loader = accelerator.prepare(model, optimizer, valid_loader)
    emulator = accelerator.unwrap_model(model)
    bounded = ", sigmoid output" if cfg.output_activation == "sigmoid" else ""
    shape = (f"IceNet (SOCA): fc1 {len(cfg.inputs)} -> {cfg.hidden}, fc2 {cfg.hidden} -> {len(cfg.outputs)}, sigmoid, "
             "no output statistics" if icenet else
             f"{cfg.layers} x {cfg.hidden} {ACTIVATION_NAMES[cfg.activation]} MLP, {len(cfg.inputs)} -> "
             f"{len(cfg.outputs)}{bounded}")
    run.print(model_line(shape, emulator))
    to_normalised = emulator.input_std[None, None, :] / emulator.output_std[None, :, None]  # physical -> normalised

    def jacobian_names(prefix: str) -> list[str]:
        """Column names of the mean |d output / d input| (output named only when there are several)."""
        return [f"{prefix}_jac_abs_mean/{f'{output}/' if len(cfg.outputs) > 1 else ''}{name}"
                for output in cfg.outputs for name in cfg.inputs]

    def validation_metrics(prefix: str, keep: list | None = None) -> dict:
        """RMSE/MAE in physical units, R^2, the normalised MSE (the training loss), the mean |Jacobian| in
        physical units (d output / d input at each validation pattern, full precision: outside autocast) and the
        mean Frobenius norm of the Jacobian in normalised units (d (y / std_y) / d (x / std_x): one number that
        does not depend on the inputs' units) over the whole split, every rank's patterns gathered (each counted
        once)."""
        sums = torch.zeros(len(cfg.outputs), 5, dtype=torch.float64)
        jacobian_sums = torch.zeros(len(cfg.outputs) * len(cfg.inputs), dtype=torch.float64)
        frobenius_sum = 0.0
        for batch in valid_loader:
            with accelerator.autocast():
                out = model(batch["x"])
            predicted = emulator.to_physical_outputs(out.float())
            full = emulator.jacobian(batch["x_physical"])  # [n, outputs, inputs], physical units
            frobenius = (full * to_normalised).square().sum(dim=(1, 2)).sqrt()  # [n]
            jacobian = full.abs().flatten(1)  # [n, outputs x inputs]
            predicted, true, jacobian, frobenius = accelerator.gather_for_metrics(
                (predicted, batch["y_true"], jacobian, frobenius)
            )
            sums += masked_error_sums(predicted, true, keep_dims=1).cpu()
            jacobian_sums += jacobian.sum(dim=0).cpu()
            frobenius_sum += float(frobenius.sum())
            if keep is not None:
                keep.append((predicted.cpu(), true.cpu()))
        metrics = {}
        normalised_mse = 0.0
        for k, name in enumerate(cfg.outputs):
            errors = error_metrics(sums[k])
            mse = errors["rmse"] ** 2
            normalised_mse += mse / float(emulator.output_std[k]) ** 2 / len(cfg.outputs)
            metrics[f"{prefix}_rmse_{name}"] = errors["rmse"]
            metrics[f"{prefix}_mae_{name}"] = errors["mae"]
            metrics[f"{prefix}_r2_{name}"] = 1.0 - mse / float(valid_variance[k])
        if sigma and len(cfg.outputs) == 1:
            metrics[f"{prefix}_rmse_over_sigma"] = metrics[f"{prefix}_rmse_{cfg.outputs[0]}"] / float(sigma)
        metrics[f"{prefix}_loss"] = normalised_mse
        for name, total in zip(jacobian_names(prefix), jacobian_sums.tolist(), strict=True):
            metrics[name] = total / meta["valid_patterns"]
        metrics[f"{prefix}_jacobian_frobenius"] = frobenius_sum / meta["valid_patterns"]
        return metrics

    # --no-stop-early: the teams' training reports the patience and trains on
    early_stopping = EarlyStopping("val_loss", cfg.patience, cfg.min_delta, min_epochs=cfg.min_epochs,
                                   stop=cfg.stop_early, why_not_stopping="reported only: --no-stop-early")

    def validate() -> dict:
        metrics = validation_metrics("val")
        early_stopping.after_evaluation(loop, metrics)
        return metrics

    loop = TrainingLoop(
        run,
        model,
        train_loader,
        evaluate=validate,
        main_metric="val_loss",
        higher_is_better=False,
        state={"early_stopping": early_stopping},
    )

    # ---- train: the loop takes the run directory and resumes; it evaluates and checkpoints when due ------------
    def train_step(batch):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                out = model(batch["x"])
            loss = normalised_mse(out, batch["y"])
            accelerator.backward(loss)
            loop.optimizer_step(optimizer, rank_loss=loss)  # equal per-rank batches: the mean of means is global

    loop.start()
    for _epoch in loop.epochs():
        for batch in loop.batches():
            loop.run_step(train_step, batch)  # --cuda-graphs: captured once, replayed
        loop.end_epoch()

    # ---- the best weights: validation metrics and the predicted-vs-true scatter (this recipe has no test split) -
    loop.load_best()
    pairs: list = []
    best_metrics = loop.test(lambda: validation_metrics("best_val", keep=pairs))
    predicted, true = torch.cat([p for p, _ in pairs]), torch.cat([t for _, t in pairs])
    run.write_artifact(
        "val_scatter.png",
        lambda path: plot_predicted_vs_true(
            path, predicted, true, cfg.outputs, meta["units"], f"validation, best step {loop.best_step}"
        ),
    )
    summary = loop.finish()
    run.print(format_table(f"validation metrics of the best step {summary['best_step']}", best_metrics))
    return summary


if __name__ == "__main__":
    main()
