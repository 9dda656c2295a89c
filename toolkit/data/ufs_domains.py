"""The sea-ice domain as each team's code selects it (`--domain`): which grid cells become patterns, one place for
training (toolkit.data.ufs.select_patterns) and predict (which passes the run's config through
toolkit.export.netcdf.selection_options).

    toolkit            ours: the mask variable > 0.5 (or --mask thickness-tair), |lat| >= --min-abs-lat in
                       --hemisphere, open water in or out (--no-open-water: aice > 0); a keyed random subset when capped
    soca               JCSDA SOCA MLBalance/KEmul/IceEmul.h selectData ("clean data": true), one model per pole:
                       umask == 1, ULAT > 40 (north) or ULAT < -40 (south), 0 < aice <= 1; prepData's cap: each rank
                       takes the first N cells of its stride i = rank, rank + W, ... and all keep the smallest count
                       (MPI_MIN), N = --max-patterns-per-rank
    soca-unclean       the same selectData with "clean data": false: ULAT > 60 (north) or ULAT < -60 (south), no
                       mask and no ice condition (land cells too, with whatever the file holds there); the same cap
    aibalance-c710abb  aibalance c710abb ufsemulator/data.py select_data, mask_mode sea_ice, min_ice 0: umask == 1, no
                       latitude bound, not aice < 0; filter_data's cap: the first --max-patterns cells in grid order
    aibalance-b1eccbc  aibalance b1eccbc (HEAD) ufsemulator/data.py on its CF files: 0 < sea_water_cell_thickness <=
                       500 and 183.15 <= tair <= 333.15 (read_netcdf_data_pair's mask), aice > 0 (mask_mode sea_ice);
                       the first --max-patterns cells in grid order. Its reader reads sst, sss, hi, hs, aice, thick
                       from the ocean file and tair, uatm, vatm, tsfc, qref from the atmosphere file, nothing else:
                       filter_data gives every other input 0 (`data.get(name, zeros)`), so sice, uocn, vocn, flwdn
                       and fswdn are zeros whatever the files hold (`zeroed_inputs`), and so they are here

A team's comparisons are taken as its code writes them (== 1, not > 0.5; > 40, not >= 40; a NaN fails each of
them), on the values as stored (float32 compared with the literal, as numpy and C++ compare them). The flags that a
team's selection fixes are refused with its domain when they differ from their defaults, in one line that says what
the team does instead; the names of the variables (--mask-variable, --lat-variable) stay the user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.errors import UsageError
from toolkit.run.randomness import keyed_uniform

AUTO = "auto"
CAP_COIN = 12  # the purpose of the keyed per-cell coin that picks a capped subset (--domain toolkit)
MASKS = ("variable", "thickness-tair")  # --mask; "none" is a team's (SOCA's clean data: false)
# aibalance b1eccbc read_netcdf_data_pair: thickness validity and tair bounds
THICKNESS_RANGE = (0.0, 500.0)  # 0 < thick <= 500 (m)
TAIR_RANGE = (183.15, 333.15)  # 183.15 <= tair <= 333.15 (K)
THICKNESS_TAIR = "0 < thick <= 500 and 183.15 <= tair <= 333.15"
# aibalance b1eccbc read_netcdf_data_pair: what it reads (our names); filter_data fills any other input with zeros
B1ECCBC_READS = ("sst", "sss", "aice", "hi", "hs", "thick", "tair", "uatm", "vatm", "tsfc", "qref")


@dataclass(frozen=True)
class DomainRule:
    """One team's selection: what it fixes and how it caps."""

    summary: str  # the rule in words (help, errors)
    mask: str | None  # "variable", "thickness-tair" or "none" as the team fixes it; None: --mask decides (toolkit)
    mask_names: tuple[str, ...]  # what --mask-variable auto tries
    lat_names: tuple[str, ...] | None  # what --lat-variable auto tries (None: the toolkit's order)
    uses_lat: bool  # the team bounds the latitude
    pole: bool  # one model per pole: --hemisphere north or south
    cap: str  # "keyed" (a keyed random subset), "first" (first N in grid order), "first-per-rank" (SOCA's)
    pole_bound: float = 40.0  # a pole's team: lat > bound (north) or lat < -bound (south)
    ice: bool = True  # a team's ice condition on aice (team_ice); False: none
    reads: tuple[str, ...] | None = None  # the inputs the team's reader reads; any other is 0 (None: every input)


DOMAINS = {
    "toolkit": DomainRule(
        "ours: --mask (the mask variable > 0.5, or thickness-tair), |lat| >= --min-abs-lat in --hemisphere, "
        "--no-open-water keeps aice > 0; capped by a keyed random subset",
        None, ("tmask", "umask"), None, True, False, "keyed"),
    "soca": DomainRule(
        "JCSDA SOCA IceEmul.h selectData, one model per pole: umask == 1, ULAT > 40 (north) or ULAT < -40 (south), "
        "0 < aice <= 1; each rank's first --max-patterns-per-rank cells of its stride, cut to the smallest rank's "
        "count",
        "variable", ("umask",), ("ULAT",), True, True, "first-per-rank"),
    "soca-unclean": DomainRule(
        "JCSDA SOCA IceEmul.h selectData with clean data: false, one model per pole: ULAT > 60 (north) or ULAT < -60 "
        "(south), no mask and no ice condition (land cells too); each rank's first --max-patterns-per-rank cells of "
        "its stride, cut to the smallest rank's count",
        "none", (), ("ULAT",), True, True, "first-per-rank", pole_bound=60.0, ice=False),
    "aibalance-c710abb": DomainRule(
        "aibalance c710abb select_data (mask_mode sea_ice): umask == 1, no latitude bound, aice >= 0 (not aice < 0); "
        "the first --max-patterns cells in grid order",
        "variable", ("umask", "mask", "land_mask", "ocean_mask"), None, False, False, "first"),
    "aibalance-b1eccbc": DomainRule(
        f"aibalance b1eccbc (HEAD) on CF files: {THICKNESS_TAIR} (thick: sea_water_cell_thickness at the surface "
        "level), aice > 0, no latitude bound; the first --max-patterns cells in grid order; sice, uocn, vocn, flwdn "
        "and fswdn are 0, as its reader gives them",
        "thickness-tair", (), None, False, False, "first", reads=B1ECCBC_READS),
}
TOOLKIT = "toolkit"
# Flag defaults (the recipe's and load_patterns'): a team's domain refuses any other value of a flag it fixes.
DEFAULTS = {"mask": "variable", "mask_variable": AUTO, "lat_variable": AUTO, "min_abs_lat": 40.0, "hemisphere": "both",
            "open_water": True, "max_patterns": 0, "max_patterns_per_rank": 0}


def domain_rule(domain: str) -> DomainRule:
    if domain not in DOMAINS:
        raise UsageError(f"--domain {domain} is invalid; give one of {', '.join(DOMAINS)}")
    return DOMAINS[domain]


def mask_kind(domain: str, mask: str) -> str:
    """The mask in effect: the team's own ("none" for SOCA's clean data: false), else --mask."""
    if mask not in MASKS:
        raise UsageError(f"--mask {mask} is invalid; give variable (the --mask-variable's cells) or thickness-tair "
                         f"({THICKNESS_TAIR})")
    return domain_rule(domain).mask or mask


def check_domain(domain: str, **flags) -> None:
    """Refuse, in one line, a flag that `domain` fixes given another value than its default (flags: the keys of
    DEFAULTS; those left out are taken as defaults). Called before any file is opened."""
    rule = domain_rule(domain)
    flags = {**DEFAULTS, **flags}
    kind = mask_kind(domain, flags["mask"])
    if flags["hemisphere"] not in ("both", "north", "south"):
        raise UsageError(f"--hemisphere {flags['hemisphere']} is invalid; give one of both, north, south")
    if kind == "thickness-tair" and flags["mask_variable"] != AUTO:
        raise UsageError(f"--mask-variable {flags['mask_variable']}: the thickness-tair mask ({THICKNESS_TAIR}) reads "
                         "no mask variable; leave --mask-variable out, or give --mask variable")
    if domain == TOOLKIT:
        return
    team = f"--domain {domain} selects as the team does ({rule.summary})"
    use = "; give --domain toolkit to choose it yourself"
    if flags["mask"] != DEFAULTS["mask"]:
        raise UsageError(f"--mask {flags['mask']}: {team}{use}")
    if kind == "none" and flags["mask_variable"] != AUTO:
        raise UsageError(f"--mask-variable {flags['mask_variable']!r}: {team}; it reads no mask: leave "
                         f"--mask-variable out{use}")
    if rule.mask == "variable" and not flags["mask_variable"]:
        raise UsageError(f"--mask-variable '': {team}; it needs its mask variable ({rule.mask_names[0]} == 1): give "
                         f"its name in the file{use}")
    if flags["min_abs_lat"] != DEFAULTS["min_abs_lat"]:
        raise UsageError(f"--min-abs-lat {flags['min_abs_lat']:g}: {team}; its latitude bound is its own{use}")
    if not flags["open_water"]:
        raise UsageError(f"--no-open-water: {team}; its ice condition is its own{use}")
    if rule.pole and flags["hemisphere"] == "both":
        raise UsageError(f"--domain {domain} trains one model per pole, as SOCA does: give --hemisphere north or "
                         "south (one run each)")
    if not rule.pole and flags["hemisphere"] != "both":
        raise UsageError(f"--hemisphere {flags['hemisphere']}: {team}; it has no hemisphere{use}")
    if not rule.uses_lat and flags["lat_variable"] != AUTO:
        raise UsageError(f"--lat-variable {flags['lat_variable']}: {team}; it reads no latitude{use}")
    if rule.cap == "first-per-rank" and flags["max_patterns"]:
        raise UsageError(f"--max-patterns {flags['max_patterns']}: SOCA caps each rank (the first N of its stride); "
                         f"give --max-patterns-per-rank {flags['max_patterns']} with --domain {domain}")
    if rule.cap == "first" and flags["max_patterns_per_rank"]:
        raise UsageError(f"--max-patterns-per-rank {flags['max_patterns_per_rank']}: aibalance caps the whole domain "
                         f"(the first N cells in grid order); give --max-patterns N with --domain {domain}")


def thickness_tair_ocean(thick: np.ndarray, tair: np.ndarray) -> np.ndarray:
    """aibalance b1eccbc's mask: 0 < thick <= 500 and 183.15 <= tair <= 333.15 (NaN fails)."""
    return (thick > THICKNESS_RANGE[0]) & (thick <= THICKNESS_RANGE[1]) & (tair >= TAIR_RANGE[0]) & (
        tair <= TAIR_RANGE[1])


def team_latitude(domain: str, hemisphere: str, lat: np.ndarray, name: str) -> tuple[np.ndarray, str]:
    """A pole's team's latitude condition on the stored values (SOCA: lat > 40.0 north, lat < -40.0 south; with
    clean data: false, 60.0) and its words."""
    bound = domain_rule(domain).pole_bound
    if hemisphere == "north":
        return lat > bound, f"{name} > {bound:g}"
    return lat < -bound, f"{name} < {-bound:g}"


def zeroed_inputs(domain: str, names) -> list[str]:
    """Our `names` that `domain`'s reader does not read and so trains on as 0 (aibalance b1eccbc: every name but
    B1ECCBC_READS, its filter_data's `data.get(name, zeros)`); [] for a domain whose reader reads every input."""
    reads = domain_rule(domain).reads
    return [] if reads is None else [name for name in names if name not in reads]


def describe_zeroed(domain: str, zeroed) -> str:
    """One line: which inputs are 0 in every pattern, and why; "" when none."""
    if not zeroed:
        return ""
    return (f"zeroed: {', '.join(zeroed)} {'is' if len(zeroed) == 1 else 'are'} 0 in every pattern, as --domain "
            f"{domain}'s reader gives {'it' if len(zeroed) == 1 else 'them'} (aibalance b1eccbc read_netcdf_data_pair "
            "reads none of them and filter_data fills them with zeros), whatever the files hold; --domain toolkit "
            "(--mask thickness-tair) reads them")


def team_ice(domain: str, aice: np.ndarray) -> tuple[np.ndarray, str]:
    """The team's ice condition on aice (as stored) and its words (a team with ice=False has none: not called)."""
    if domain == "soca":
        return (aice > 0.0) & (aice <= 1.0), "0 < aice <= 1"
    if domain == "aibalance-c710abb":
        return ~(aice < 0.0), "aice >= 0"  # `if aice < min_ice: return False`: a NaN is kept, as there
    return aice > 0.0, "aice > 0"


def first_per_rank(cells: np.ndarray, per_rank: int, world: int) -> np.ndarray:
    """SOCA prepData: rank r walks the grid cells i = r, r + W, ... and takes the domain cells it meets, at most
    `per_rank` (0 = no cap); every rank then keeps the smallest count (MPI_MIN) of its first ones. The union, in
    grid order."""
    shares = [cells[cells % world == rank] for rank in range(world)]
    keep = min(min(len(share), per_rank) if per_rank else len(share) for share in shares)
    return np.sort(np.concatenate([share[:keep] for share in shares]))


def cap_cells(domain: str, cells: np.ndarray, *, max_patterns: int, max_patterns_per_rank: int, world: int,
              seed: int) -> np.ndarray:
    """The domain's cells (ascending flat numbers) after the domain's cap."""
    cap = domain_rule(domain).cap
    if cap == "first-per-rank":
        return first_per_rank(cells, max_patterns_per_rank, world)
    if cap == "first":
        return cells[:max_patterns] if max_patterns else cells
    limit = min((c for c in (max_patterns, max_patterns_per_rank * world) if c), default=0)
    if limit and len(cells) > limit:
        coins = keyed_uniform(seed, CAP_COIN, 0, torch.from_numpy(cells)).numpy()
        cells = np.sort(cells[np.argsort(coins, kind="stable")[:limit]])
    return cells


def depends_on_world(domain: str, max_patterns_per_rank: int) -> bool:
    """Whether the patterns depend on the process count (then another count is another data set)."""
    return domain_rule(domain).cap == "first-per-rank" or bool(max_patterns_per_rank)


def cut_by_cap(domain: str, patterns: int, domain_cells: int, thin: int, max_patterns_per_rank: int) -> bool:
    """Whether a cap that depends on the process count took fewer cells than the (thinned) domain holds."""
    return depends_on_world(domain, max_patterns_per_rank) and patterns < math.ceil(domain_cells / thin)


