"""A checkpoint of the reference HRM (sapientinc/HRM, commit 42410da) loaded into ours by a name map.

pretrain.py saves `torch.save(model.state_dict(), "step_N")`: the loss head's plain state dict (the layout of a
pytorch_model.bin), its names those of ACTLossHead(model=HierarchicalReasoningModel_ACTV1(inner=...)), e.g.
`model.inner.H_level.layers.0.self_attn.qkv_proj.weight`, each with a `_orig_mod.` prefix when the model was
torch.compile'd (the reference's default; its evaluate.py strips it the same way). Its non-persistent buffers (the
RoPE tables, the sparse embedding's local rows) are not in it; ours are rebuilt alike.

The map is one rule per kind of tensor (REFERENCE_RULES, reference -> ours); the layouts agree tensor for tensor (q,
k and v side by side in qkv_proj, gate then up in gate_up_proj: tests/test_hrm_reference.py runs the reference's
forward on our weights under these names). Each tensor is cast to our tensor's dtype (the reference keeps H_init and
L_init in its forward dtype, bfloat16; a cast to float32 is exact).

What does not fit is one line each: a tensor whose shape differs from ours, or one of ours the checkpoint lacks (the
model settings differ from the checkpoint's: say which flags to give), is refused (UsageError), and so are arch
settings that differ from those in the all_config.yaml pretrain.py writes beside its checkpoints (heads and cycles
show in no shape); a checkpoint tensor with no counterpart in our model is listed in one line and left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from toolkit.errors import UsageError

COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper adds it to every name
INNER = "model.inner."  # ACTLossHead.model (the ACT wrapper) .inner (the reasoning model)

# reference name (after INNER) -> ours, full matches, the first that matches wins
REFERENCE_RULES = [
    (r"embed_tokens\.embedding_weight", "embed_tokens.weight"),
    (r"embed_pos\.embedding_weight", "embed_pos"),
    (r"puzzle_emb\.weights", "puzzle_emb.table"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"q_head\.(weight|bias)", r"q_head.\1"),
    (r"H_init", "h_init"),
    (r"L_init", "l_init"),
    (r"H_level\.layers\.(\d+)\.(.+)", r"h_level.blocks.\1.\2"),
    (r"L_level\.layers\.(\d+)\.(.+)", r"l_level.blocks.\1.\2"),
]
BLOCK_RULES = [  # inside a block
    (r"self_attn\.qkv_proj\.weight", "attention.qkv.weight"),
    (r"self_attn\.o_proj\.weight", "attention.out.weight"),
    (r"mlp\.gate_up_proj\.weight", "mlp.gate_up.weight"),
    (r"mlp\.down_proj\.weight", "mlp.down.weight"),
]
PRESENCE = {"embed_pos": "--positions", "h_level": "--h-layers", "l_level": "--l-layers"}  # what makes a tensor be
SHAPES = " (--hidden, --expansion, ...)"  # what makes the shapes (heads and cycles change none: see ARCH)
CONFIG_FILE = "all_config.yaml"  # pretrain.py's record of a run's settings, in its checkpoints' folder
ARCH = {  # the reference's arch settings that no shape shows, or that decide them -> our flag
    "hidden_size": "--hidden", "num_heads": "--heads", "expansion": "--expansion", "H_layers": "--h-layers",
    "L_layers": "--l-layers", "H_cycles": "--h-cycles", "L_cycles": "--l-cycles", "pos_encodings": "--positions",
}


def our_name(reference: str) -> str | None:
    """Our name for a reference checkpoint's tensor (the `_orig_mod.` prefix dropped), None when there is none."""
    name = reference.removeprefix(COMPILED_PREFIX)
    if not name.startswith(INNER):
        return None
    name = name[len(INNER):]
    for pattern, replacement in REFERENCE_RULES:
        match = re.fullmatch(pattern, name)
        if match is None:
            continue
        ours = match.expand(replacement)
        if ours.startswith(("h_level.", "l_level.")):
            level, blocks, index, inside = ours.split(".", 3)
            for inner_pattern, inner_replacement in BLOCK_RULES:
                if re.fullmatch(inner_pattern, inside):
                    return f"{level}.{blocks}.{index}.{inner_replacement}"
            return None
        return ours
    return None


def read_reference_state(path: Path, flag: str = "--init-from-reference") -> dict[str, torch.Tensor]:
    """The tensors of a torch.save'd state dict, read on the CPU (no code runs: weights_only). One UsageError line
    when the path is missing or is not such a file."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise UsageError(f"{flag} {path} {what}; give the reference's checkpoint file (pretrain.py's "
                         "checkpoints/.../step_N, a torch.save'd state dict)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file (pickle, zip, EOF, a disallowed type): one line
        detail = " ".join(str(error).split())[:160]
        raise UsageError(f"{flag} {path} could not be read as a torch.save'd state dict ({type(error).__name__}: "
                         f"{detail}); give the reference's checkpoint file (pretrain.py's step_N)") from None
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"{flag} {path} holds no state dict of tensors; give the reference's checkpoint file "
                         "(pretrain.py's step_N, torch.save(model.state_dict()))")
    return state


def map_reference_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: Path | str = "",
                        flag: str = "--init-from-reference") -> tuple[dict[str, torch.Tensor], list[str]]:
    """({our name: tensor cast to our dtype} covering every tensor of `expected` (our state dict, or one of meta
    tensors), [the checkpoint's names with no counterpart in ours]). Refuses a shape that differs and a tensor of
    ours that the checkpoint lacks, in one UsageError line each."""
    mapped: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for name, tensor in state.items():
        ours = our_name(name)
        if ours is None or ours not in expected:
            unmapped.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected[ours].shape):
            raise UsageError(f"{flag} {path}: {name} has shape {list(tensor.shape)} where this model's {ours} has "
                             f"{list(expected[ours].shape)}; give the model settings the checkpoint was trained with"
                             f"{SHAPES}")
        mapped[ours] = tensor.to(expected[ours].dtype)
    missing = [name for name in expected if name not in mapped]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UsageError(f"{flag} {path} lacks this model's {shown}; give the model settings the checkpoint was "
                         f"trained with{_hint(*missing)}")
    return mapped, unmapped


def _hint(*names: str) -> str:
    flags = sorted({flag for name in names for prefix, flag in PRESENCE.items() if name.startswith(prefix)})
    return f" ({', '.join(flags)}, ...)" if flags else SHAPES


def refuse_other_settings(path: Path, ours: dict, flag: str = "--init-from-reference") -> None:
    """When the checkpoint's folder holds the reference's all_config.yaml (pretrain.py writes it there), its arch
    settings must be ours ({our flag: value}): the heads and cycles show in no shape, and weights run with others
    compute something else. One UsageError line naming each that differs; no such file: nothing to compare."""
    import yaml  # (Accelerate's dependency) only here: a checkpoint without the file never needs it

    record = Path(path).expanduser().parent / CONFIG_FILE
    if not record.is_file():
        return
    try:
        arch = yaml.safe_load(record.read_text())["arch"]
        differ = [f"{our_flag} {ours[our_flag]} here, {arch[key]} there" for key, our_flag in ARCH.items()
                  if key in arch and our_flag in ours and arch[key] != ours[our_flag]]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError) as error:
        raise UsageError(f"{flag} {path}: {record}, the reference's record of its settings, could not be read "
                         f"({type(error).__name__}); fix or remove it") from None
    if differ:
        raise UsageError(f"{flag} {path} was trained with other settings ({record}): {'; '.join(differ)}; give "
                         "its values")


def unmapped_line(unmapped: list[str], path: Path | str, flag: str = "--init-from-reference") -> str | None:
    """One line naming the checkpoint's tensors that were left out (None when every one was loaded)."""
    if not unmapped:
        return None
    shown = ", ".join(unmapped[:6]) + (f" and {len(unmapped) - 6} more" if len(unmapped) > 6 else "")
    return f"{flag} {path}: {len(unmapped)} tensor(s) with no counterpart in this model left out: {shown}"


def load_reference_checkpoint(model: torch.nn.Module, path: Path, flag: str = "--init-from-reference") -> list[str]:
    """Read the reference's checkpoint at `path` into `model` (ours, unwrapped); returns the lines to say (what was
    loaded, and what was left out)."""
    state = read_reference_state(path, flag)
    mapped, unmapped = map_reference_state(state, model.state_dict(), path, flag)
    model.load_state_dict(mapped, strict=True)
    lines = [f"{flag} {path}: {len(mapped)} tensors of the reference's checkpoint loaded"]
    left_out = unmapped_line(unmapped, path, flag)
    return lines + ([left_out] if left_out else [])
