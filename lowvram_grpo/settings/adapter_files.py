"""A user's saved LoRA adapter, read before any model loads: its settings (adapter_config.json), whether its
weights file is whole, and which of its options our merge reproduces. Pure Python: settings/ checks an adapter with
these (config.py, checks.py); model/ (lora_io.py, decoding.py) loads and decodes with the same answers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from lowvram_grpo.core.errors import AdapterError

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's current and older weights file
# adapter_config.json keys that shape the LoRA beyond r / alpha / targets / dropout, passed on when set
LORA_EXTRAS = ("bias", "use_rslora", "modules_to_save", "layers_to_transform", "layers_pattern")


def adapter_settings(path) -> dict:
    """The LoRA settings of the saved PEFT adapter at `path` (ours or another tool's), from its
    adapter_config.json: r, alpha, target_modules, dropout, the base model it was trained on and the
    extras (LORA_EXTRAS). AdapterError with one line when it is not a LoRA adapter that can be trained on."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        if (path / "adapter" / "adapter_config.json").is_file():
            raise AdapterError(f"{path} holds a run, not an adapter: give its adapter, {path / 'adapter'}")
        what = "does not exist" if not path.exists() else "is not a PEFT adapter (no adapter_config.json)"
        raise AdapterError(f"{path} {what}: give the folder of a saved PEFT LoRA adapter "
                           "(adapter_config.json + weights)")
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        raise AdapterError(f"adapter at {path} has no weights ({' or '.join(ADAPTER_WEIGHTS)})")
    if (path / ADAPTER_WEIGHTS[0]).is_file():
        problem = safetensors_problem(path / ADAPTER_WEIGHTS[0])
        if problem:
            raise AdapterError(f"adapter at {path} has a damaged {ADAPTER_WEIGHTS[0]} ({problem}): "
                               "give an adapter folder saved completely (a run's adapter/ or checkpoint-N/)")
    try:
        raw = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter at {path} has an unreadable adapter_config.json ({exc})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else type(raw).__name__
        raise AdapterError(f"adapter at {path} is a {kind} adapter: only LoRA adapters can be trained on here")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"adapter at {path} names its target modules as {targets!r}, not a list of layer names: "
                           "only listed target_modules can be trained on here")
    alpha = raw.get("lora_alpha", raw.get("r"))
    if not isinstance(raw.get("r"), int) or not isinstance(alpha, (int, float)) or alpha != int(alpha):
        raise AdapterError(f"adapter at {path} has r={raw.get('r')!r}, lora_alpha={alpha!r}: expected whole numbers")
    return {"r": raw["r"], "alpha": int(alpha), "target_modules": sorted(targets),
            "dropout": float(raw.get("lora_dropout") or 0.0), "base_model": raw.get("base_model_name_or_path"),
            "extras": {key: raw[key] for key in LORA_EXTRAS if raw.get(key) not in (None, False, "none", [], {})}}


def safetensors_problem(path: Path) -> Optional[str]:
    """Why the safetensors file at `path` cannot be read whole (a truncated copy, another format), or None; from
    its header alone, without torch: 8 bytes of header length, the JSON header, every tensor's bytes inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(head, "little")
            if length > size - 8:
                return f"its header says {length} bytes, the file holds {size}"
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as exc:
        return f"unreadable header: {type(exc).__name__}"
    if not isinstance(header, dict):
        return "unreadable header"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2]
    if not ends:
        return "no tensors in it"
    needed = 8 + length + max(ends)
    if needed > size:
        return f"truncated: {size} of {needed} bytes"
    return None


# LoraConfig options (adapter_config.json keys) our merge reproduces with PEFT's own arithmetic (peft 0.21
# lora.Linear.get_delta_weight: W + scale * B @ A, scale = alpha / r, or alpha / sqrt(r) with use_rslora, r and alpha
# per module from rank_pattern / alpha_pattern), or that do not change what a forward computes (which modules carry
# the adapter, dropout: off in eval, how it was initialised, bookkeeping). Any other option set away from PEFT's
# default keeps the adapter unmerged.
MERGE_OPTIONS = frozenset({
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "fan_in_fan_out", "bias", "ensure_weight_tying",
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "runtime_config", "init_lora_weights",
})
# init_lora_weights values that only set the starting A and B (PiSSA, OLoRA, CorDA, EVA, LoftQ also rewrite the
# base weights or the adapter's meaning; "mica" is a PEFT variant with its own forward)
PLAIN_INITS = (True, False, "gaussian", "orthogonal")
# options beyond the merge that our loop decodes unmerged: PEFT's forward of each layer, with no generate-time input
# (DoRA's magnitude, lora_bias's bias on B, a full copy of a module); any other (aLoRA's invocation offsets, which
# PEFT's generate computes; Arrow's routing; BD-LoRA, VeLoRA, MonteCLoRA, KaSA, QALoRA, layer replication, trainable
# tokens, LoRA on parameters, a newer PEFT's keys ...) sends generation to transformers' generate through PEFT's
UNMERGED_OPTIONS = frozenset({"use_dora", "lora_bias", "modules_to_save"})


# LoraConfig defaults (peft 0.21) outside MERGE_OPTIONS that are not None, False, empty or "none": a value equal to
# one of these is unset too (tests/test_decoding.py checks every LoraConfig field's default against this rule)
SET_DEFAULTS = {"megatron_core": "megatron.core", "qalora_group_size": 16}
_UNSET = (None, False, [], {}, "none")


def options_beyond_merge(adapter_config: dict) -> list[str]:
    """The options of one LoRA adapter's config (`adapter_config.json`'s dict, or LoraConfig.to_dict()) outside
    MERGE_OPTIONS that are set (not None/False/empty/"none", nor a default of SET_DEFAULTS), sorted; an
    init_lora_weights outside PLAIN_INITS counts. A key this PEFT does not know counts when it is set. Pure Python
    (the settings check calls it before anything loads)."""
    beyond = []
    for key, value in adapter_config.items():
        if key == "init_lora_weights":
            if value not in PLAIN_INITS:
                beyond.append(key)
        elif key not in MERGE_OPTIONS and value not in _UNSET and SET_DEFAULTS.get(key, _UNSET) != value:
            beyond.append(key)
    return sorted(beyond)
