"""Tiny random models of the families people train today, built from transformers' own config classes (2 layers,
64 wide) and saved with a small tokenizer and a chat template in the family's own form, for tests/test_families.py.

`FAMILIES`: family -> (config class name in transformers, its extra settings, LoRA target modules, chat form).
`build(family, folder)` writes an ordinary checkpoint folder (config.json, model.safetensors, tokenizer files),
atomically and once per cache folder (model_cache.build_once). The tokenizer is the built-in tiny model's byte-level
BPE (builtin_models) with the family's turn tokens added and its chat template:
- `chatml_thinking` (Qwen3, Qwen3.5, SmolLM3): ChatML whose generation prompt closes an empty <think> block when
  `enable_thinking` is false, as Qwen3's own template does;
- `gemma`: <start_of_turn>user / model ... <end_of_turn>, the system message put in the first user turn;
- `llama3`: <|start_header_id|>role<|end_header_id|> ... <|eot_id|> (Llama 3.2);
- `harmony`: gpt-oss's <|start|>role<|message|> ... <|end|>, the answer on the final channel.
"""
from __future__ import annotations

from pathlib import Path

CHATML_THINKING = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
GEMMA = (
    "{{- bos_token }}{%- set first = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{%- for message in messages[first:] %}{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else "
    "'user') + '\\n' }}{%- if loop.first and first %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
HARMONY = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant<|channel|>final<|message|>' }}{%- endif %}")
CHAT_FORMS = {  # form -> (template, its turn tokens, the end-of-turn token)
    "chatml_thinking": (CHATML_THINKING, [], "<|im_end|>"),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "harmony": (HARMONY, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>"], "<|end|>"),
}
ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # gpt-oss: its experts are fused tensors, not nn.Linear

FAMILIES = {
    "qwen3": ("Qwen3Config", {}, ATTENTION_AND_MLP, "chatml_thinking"),
    # Qwen3.5: one Gated DeltaNet (linear attention) layer and one full-attention layer
    "qwen3_5": ("Qwen3_5TextConfig", {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                                      "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
                ATTENTION_AND_MLP, "chatml_thinking"),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
               ATTENTION_AND_MLP, "gemma"),
    "gemma4": ("Gemma4TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                                    "hidden_size_per_layer_input": 8},
               ATTENTION_AND_MLP, "gemma"),
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}, ATTENTION_AND_MLP, "llama3"),  # Llama 3.2: tied embeddings
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                                 "layer_types": ["sliding_attention", "full_attention"]}, ATTENTION, "harmony"),
    "smollm3": ("SmolLM3Config", {}, ATTENTION_AND_MLP, "chatml_thinking"),
}
# A family our decode loop was not checked on (decoding.LOOP_TYPES): the run keeps transformers' generate for it.
UNCHECKED = {"phi3": ("Phi3Config", {"pad_token_id": None}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                      "chatml_thinking")}
VERSION = "v1"  # bump when a recipe above changes: the cached folders are rebuilt


def _build(family: str, target: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowvram_grpo.builtin_models import ensure_tiny_model

    config_name, extra, _, form = {**FAMILIES, **UNCHECKED}[family]
    template, specials, end_of_turn = CHAT_FORMS[form]
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = end_of_turn
    tokenizer.chat_template = template
    vocab = len(tokenizer)
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
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
    from lowvram_grpo.model_cache import build_once

    return build_once(f"tiny-family-{family}-{VERSION}", lambda target: _build(family, target))
