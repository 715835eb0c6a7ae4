"""Tiny random models of the families people train today, built from transformers' own config classes (2 layers,
64 wide) and saved with a small tokenizer and the family's chat template, for tests/test_families.py and
tests/test_unsloth_families.py.

`FAMILIES`: family -> (config class name in transformers, its extra settings, LoRA target modules, chat form).
`build(family)` writes an ordinary checkpoint folder (config.json, model.safetensors, tokenizer files) once per cache
folder (model_cache.build_once: atomic). The tokenizer is the built-in tiny model's byte-level BPE (builtin_models)
with the family's turn tokens added; its chat template is the family's own as the pinned unsloth ships it
(unsloth/chat_templates.py, read as text from the installed wheel: nothing of unsloth is imported):
`qwen3` (Qwen3's, whose generation prompt closes an empty <think> block when `enable_thinking` is false; also for
Qwen3.5 and SmolLM3), `gemma3`, `gemma-4` (<|turn> ... <turn|>, `enable_thinking` puts <|think|> in the system
turn), `llama-3.1` (Llama 3.2's format), `gpt-oss` (harmony, with `reasoning_effort`).
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

CHAT_FORMS = {  # form -> (its template's key in unsloth's CHAT_TEMPLATES, its turn tokens, the end-of-turn token)
    "qwen3": ("qwen3", [], "<|im_end|>"),
    "gemma": ("gemma3", ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "gemma4": ("gemma-4", ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"], "<turn|>"),
    "llama3": ("llama-3.1", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "harmony": ("gpt-oss", ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"], "<|return|>"),
}


def unsloth_template(key: str) -> str:
    """The chat template unsloth's CHAT_TEMPLATES holds under `key`, read from the installed wheel's source."""
    source = Path(importlib.util.find_spec("unsloth").origin).parent / "chat_templates.py"
    tree = ast.parse(source.read_text())
    strings, entries = {}, {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            strings[target.id] = node.value.value
        elif (isinstance(target, ast.Subscript) and getattr(target.value, "id", "") == "CHAT_TEMPLATES"
              and isinstance(node.value, ast.Tuple) and isinstance(node.value.elts[0], ast.Name)):
            entries[ast.literal_eval(target.slice)] = node.value.elts[0].id
    return strings[entries[key]]


ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # gpt-oss: its experts are fused tensors, not nn.Linear

FAMILIES = {
    "qwen3": ("Qwen3Config", {}, ATTENTION_AND_MLP, "qwen3"),
    # Qwen3.5: one Gated DeltaNet (linear attention) layer and one full-attention layer
    "qwen3_5": ("Qwen3_5TextConfig", {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                                      "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                      "linear_value_head_dim": 16},
                ATTENTION_AND_MLP, "qwen3"),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
               ATTENTION_AND_MLP, "gemma"),
    "gemma4": ("Gemma4TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                                    "hidden_size_per_layer_input": 8},
               ATTENTION_AND_MLP, "gemma4"),
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}, ATTENTION_AND_MLP, "llama3"),  # Llama 3.2: tied embeddings
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                                 "layer_types": ["sliding_attention", "full_attention"]}, ATTENTION, "harmony"),
    "smollm3": ("SmolLM3Config", {}, ATTENTION_AND_MLP, "qwen3"),
}
# Earlier families our decode loop also covers (decoding.LOOP_TYPES), checked by its equality test only.
LOOP_ONLY = {"qwen2": ("Qwen2Config", {}, ATTENTION_AND_MLP, "qwen3"),
             "mistral": ("MistralConfig", {"sliding_window": 16}, ATTENTION_AND_MLP, "qwen3")}
# A family our decode loop was not checked on (decoding.LOOP_TYPES): the run keeps transformers' generate for it.
UNCHECKED = {"phi3": ("Phi3Config", {"pad_token_id": None}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                      "qwen3")}
VERSION = "v3"  # bump when a recipe above changes: the cached folders are rebuilt


def _build(family: str, target: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    config_name, extra, _, form = {**FAMILIES, **LOOP_ONLY, **UNCHECKED}[family]
    key, specials, end_of_turn = CHAT_FORMS[form]
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = end_of_turn
    tokenizer.chat_template = unsloth_template(key)
    vocab = len(tokenizer)
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    if family == "gemma4":
        settings["vocab_size_per_layer_input"] = vocab
    config = getattr(transformers, config_name)(**{**settings, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def build(family: str) -> Path:
    """The family's tiny checkpoint folder, built on first use (cached like the built-in tiny model)."""
    from lowvram_grpo.model.model_cache import build_once

    return build_once(f"tiny-family-{family}-{VERSION}", lambda target: _build(family, target))
