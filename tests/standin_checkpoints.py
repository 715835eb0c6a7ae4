"""Stand-in checkpoints of the GPU presets' models, built from each model's real config.json (committed under
tests/fixtures/checkpoints/<model>/, with SOURCES.md) scaled down in width and depth only: the architectures, the model
and layer types, the vision tower, tied embeddings, sliding windows, rope and the vocabulary size stay the model's own.

    folder = build("unsloth/Qwen3.5-0.8B", cache)   # config.json, random bf16 weights, tokenizer (and processor files)

The tokenizer is the built-in tiny model's byte-level BPE with the model's special tokens added, its chat template
unsloth's for the family (tests/tiny_families.unsloth_template), saved with the real tokenizer_config.json's
`tokenizer_class` and special-token names; the processor's files (preprocessor_config.json and the video one) are the
model's own where it has them, so transformers' Auto classes pick the model's own classes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
WIDTH = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16}
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16}
VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4}
# model_type -> (unsloth chat template key, special tokens the template and the configs name)
FAMILY = {
    "qwen2": ("qwen-2.5", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|PAD_TOKEN|>"]),
    "qwen3": ("qwen3", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|PAD_TOKEN|>", "<think>", "</think>"]),
    "qwen3_5": ("qwen3", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|image_pad|>",
                          "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]),
    "llama": ("llama-3.1", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                            "<|finetune_right_pad_id|>"]),
    "gemma3_text": ("gemma3", ["<bos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<unk>"]),
}
VERSION = "v3"  # bump when the scaling below changes: cached folders are rebuilt


def fixture(model_name: str) -> Path:
    """The committed real-config folder of `model_name` (its last path part)."""
    return FIXTURES / model_name.rstrip("/").split("/")[-1]


def _depth(text: dict) -> int:
    """Layers kept: one period of the layer-type pattern (every type once, in the model's order), else 2."""
    types = text.get("layer_types")
    if not types:
        return 2
    for n in range(1, len(types) + 1):
        if set(types[:n]) == set(types) and types[n - 1] != types[0]:
            return n
    return len(types)


def scaled_text(text: dict) -> dict:
    """A text config scaled in width and depth; everything else the model's own."""
    out = dict(text)
    heads, kv = text["num_attention_heads"], text.get("num_key_value_heads", text["num_attention_heads"])
    out.update(WIDTH)
    out["num_key_value_heads"] = 1 if kv == 1 else 2
    rope = dict(out.get("rope_parameters") or {})
    if rope.get("mrope_section"):  # Qwen3.5: multimodal rope sections sum to head_dim * partial_rotary_factor / 2
        out["head_dim"] = 64
        rotary_half = int(64 * rope.get("partial_rotary_factor", 1.0)) // 2
        sections = rope["mrope_section"]
        scaled = [max(1, round(s * rotary_half / sum(sections))) for s in sections]
        scaled[-1] = rotary_half - sum(scaled[:-1])
        rope["mrope_section"] = scaled
        out["rope_parameters"] = rope
    depth = _depth(text)
    out["num_hidden_layers"] = depth
    if text.get("layer_types"):
        out["layer_types"] = text["layer_types"][:depth]
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], depth)
    for key, value in LINEAR.items():
        if key in out:
            out[key] = value
    assert heads % kv == 0
    return out


def scaled_config(config: dict) -> dict:
    """The whole config.json scaled (a vision-language config: its text_config and vision_config)."""
    if "text_config" not in config:
        return scaled_text(config)
    out = dict(config)
    out["text_config"] = scaled_text(config["text_config"])
    if "vision_config" in config:
        vision = dict(config["vision_config"])
        vision.update(VISION)
        vision["out_hidden_size"] = out["text_config"]["hidden_size"]
        out["vision_config"] = vision
    return out


def _text_type(config: dict) -> str:
    return config.get("model_type") if "text_config" not in config else config["model_type"]


def _build(model_name: str, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from lowvram_grpo.model.builtin_models import ensure_tiny_model
    from tests.tiny_families import unsloth_template

    source = fixture(model_name)
    real = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(scaled_config(real), indent=2))
    template, specials = FAMILY[_text_type(real)]
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = unsloth_template(template)
    real_tok = json.loads((source / "tokenizer_config.json").read_text())
    for role in ("bos_token", "eos_token", "pad_token"):
        if real_tok.get(role) and real_tok[role] in tokenizer.get_vocab():
            setattr(tokenizer, role, real_tok[role])
    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if "vision_config" in real else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    (target / "config.json").write_text(json.dumps(scaled_config(real), indent=2))  # the fixture's fields, as written
    tokenizer.save_pretrained(target)
    _specials_in_vocab(target / "tokenizer.json")
    saved = json.loads((target / "tokenizer_config.json").read_text())
    saved["tokenizer_class"] = real_tok["tokenizer_class"]
    for key in ("image_token", "video_token", "vision_bos_token", "vision_eos_token", "padding_side"):
        if key in real_tok:
            saved[key] = real_tok[key]
    (target / "tokenizer_config.json").write_text(json.dumps(saved, indent=2))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)


def _specials_in_vocab(path: Path) -> None:
    """The added special tokens also in the BPE model's vocabulary, where classes such as GemmaTokenizer look their
    unk / pad tokens up (the real tokenizers have them there)."""
    data = json.loads(path.read_text())
    for token in data.get("added_tokens", []):
        data["model"]["vocab"].setdefault(token["content"], token["id"])
    path.write_text(json.dumps(data, ensure_ascii=False))


def build(model_name: str, cache: Path) -> Path:
    """The stand-in folder of `model_name` under `cache`, built once (atomic: a half-built folder is never used)."""
    target = Path(cache) / f"{fixture(model_name).name}-{VERSION}"
    if (target / "config.json").exists():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _build(model_name, partial)
    partial.rename(target)
    return target
