"""Named presets: sets of flag defaults a recipe offers, chosen with `--preset NAME`, any other flag on top.

A recipe declares them once, in the shape of tyro's `overridable_config_cli`, the first being the default:

    PRESETS = {
        "cpu": ("small and quick: minutes on 2 CPU cores", DCRNNConfig()),
        "metr-la": ("the paper's settings", DCRNNConfig(units=64, epochs=100)),
    }
    cfg = parse_config(PRESETS, argv, description=__doc__)

and `toolkit.run.config.parse_config` does the rest with tyro's own named default configs
(`tyro.extras.subcommand_type_from_defaults`): each preset is a subcommand whose default instance gives the flags'
defaults, so `--preset metr-la --help` shows metr-la's values. tyro spells the choice as a positional subcommand
(`dcrnn.py metr-la --epochs 3`); `--preset NAME` anywhere on the line is moved there here, once for every recipe, so
no recipe reads argv by hand. Without a preset, the first one is used. config.json records the name (`preset`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import tyro

from toolkit.errors import UsageError

ConfigT = TypeVar("ConfigT")
Presets = Mapping[str, tuple[str, Any]]  # name -> (one line for --help, config instance); the first is the default
FLAG = "--preset"


def split_preset(presets: Presets, args: list[str]) -> tuple[str, list[str]]:
    """(the chosen preset's name, the other arguments). `--preset NAME` / `--preset=NAME` may stand anywhere (the
    last one wins, as for any flag); tyro's own form, the name as the first argument, works too; neither: the
    default (first) preset. An unknown name is one UsageError line naming the valid ones."""
    names = list(presets)
    chosen, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == FLAG or arg.startswith(FLAG + "="):
            if arg == FLAG and i + 1 == len(args):
                raise UsageError(f"{FLAG} needs a NAME; use one of {', '.join(names)}")
            chosen = args[i + 1] if arg == FLAG else arg.partition("=")[2]
            i += 2 if arg == FLAG else 1
            if chosen not in presets:
                raise UsageError(f"{FLAG} {chosen} is unknown; use one of {', '.join(names)}")
            continue
        rest.append(arg)
        i += 1
    if rest and rest[0] in presets:  # tyro's positional form
        positional = rest.pop(0)
        if chosen is not None and chosen != positional:
            raise UsageError(f"two presets were given ({positional} and {FLAG} {chosen}); give one")
        chosen = positional
    return chosen or names[0], rest


def preset_type(presets: Presets, description: str | None) -> Any:
    """The union tyro parses: one subcommand per preset, its instance (with `preset` set to its name) giving the
    defaults. Each subcommand's help is the recipe's description, the list of presets and which one it shows."""
    listing = _listing(presets)
    return tyro.extras.subcommand_type_from_defaults(
        {name: named(presets, name) for name in presets},
        {name: f"{description or ''}\n\n{listing}\n\nThe defaults below are those of preset `{name}`."
         for name in presets},
    )


def named(presets: Presets, name: str) -> Any:
    """A copy of preset `name`'s config, its `preset` field set to the name (so config.json records it)."""
    return dataclasses.replace(presets[name][1], preset=name)


def _listing(presets: Presets) -> str:
    labels = [f"{name} (default)" if i == 0 else name for i, name in enumerate(presets)]
    width = max(len(label) for label in labels)
    lines = [f"Presets ({FLAG} NAME; any other flag overrides the preset's value):"]
    lines += [f"  {label.ljust(width)}  {line}" for label, (line, _) in zip(labels, presets.values(), strict=True)]
    return "\n".join(lines)
