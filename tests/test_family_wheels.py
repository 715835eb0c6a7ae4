"""What the pinned wheels do with each model family, read from the installed GPU set (issue 52): the facts
lowvram_grpo.settings.model_shapes states (VLLM_FAMILIES, UNSLOTH_NO_VLLM, UNSLOTH_VLLM_NEEDS_SM80,
UNSLOTH_FORCE_FLOAT32) against vLLM 0.31's model registry and model classes (SupportsLoRA; packed_modules_mapping and
load_weights, what vllm-bnb-plugin's loader requires), the plugin's loader, unsloth's loader and unsloth_zoo's model
lists; and unsloth_zoo's own vLLM sizing, extracted from the installed source, on the sliding-window and q/k-norm
families. Nothing is imported from vLLM or unsloth (they need CUDA): their source is parsed (ast).

Runs in the GPU install set (CI's GPU-set stage, .ci/run); skips elsewhere, fails there under LOWVRAM_GRPO_GPU_SET=1.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from conftest import require_gpu_set

pytestmark = pytest.mark.slow

PINS = require_gpu_set()
SITE = Path(importlib.util.find_spec("vllm").origin).parent.parent
MODELS = SITE / "vllm" / "model_executor" / "models"
BNB_LOADER = SITE / "vllm_bnb_plugin" / "bitsandbytes_loader.py"
UNSLOTH_LOADER = SITE / "unsloth" / "models" / "loader.py"
ZOO_MODEL_LISTS = SITE / "unsloth_zoo" / "model_lists.py"
# the config.json model_type(s) unsloth's loader sees for each family (a multimodal model: the top one and its text's)
MODEL_TYPES = {"llama": ["llama"], "qwen2": ["qwen2"], "qwen3": ["qwen3"], "qwen3_5": ["qwen3_5", "qwen3_5_text"],
               "gemma3": ["gemma3_text"], "gpt_oss": ["gpt_oss"]}
# the checkpoints' own quantization (config.json quantization_config.quant_method): gpt-oss ships its experts in MXFP4
CHECKPOINT_QUANT = {"gpt_oss": "mxfp4"}


def _registry() -> dict[str, tuple[str, str]]:
    """vLLM's model registry (vllm/model_executor/models/registry.py): architecture -> (module, class)."""
    tree = ast.parse((MODELS / "registry.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2
                        and all(isinstance(e, ast.Constant) for e in value.elts)):
                    found.setdefault(key.value, (value.elts[0].value, value.elts[1].value))
    return found


def _module(name: str):
    text = (MODELS / f"{name}.py").read_text()
    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {alias.asname or alias.name: (node.module, alias.name) for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module for alias in node.names}
    return classes, imported


def _class_facts(module: str, cls: str, seen=None) -> dict:
    """Bases (names, transitively through the package's own classes), whether the class or an ancestor assigns
    packed_modules_mapping and defines load_weights."""
    seen = seen if seen is not None else set()
    classes, imported = _module(module)
    node = classes[cls]
    facts = {"bases": set(), "packed": False, "load_weights": False}
    for item in node.body:
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            facts["packed"] |= any(isinstance(t, ast.Name) and t.id == "packed_modules_mapping" for t in targets)
        facts["load_weights"] |= isinstance(item, ast.FunctionDef) and item.name == "load_weights"
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else ast.unparse(base)
        facts["bases"].add(name)
        where = (module, name) if name in classes else None
        if name in imported and imported[name][0] != "interfaces" and (MODELS / f"{imported[name][0]}.py").is_file():
            where = imported[name]
        if where and where not in seen:
            seen.add(where)
            inherited = _class_facts(where[0], where[1], seen)
            facts["bases"] |= inherited["bases"]
            facts["packed"] |= inherited["packed"]
            facts["load_weights"] |= inherited["load_weights"]
    return facts


def _assigned(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} is not assigned in {path}")


def test_every_family_is_served_as_model_shapes_says():
    """For each family: the registry maps its architecture to the file and class named; the class is SupportsLoRA
    as `lora` says; vllm-bnb-plugin can load it in 4-bit (packed_modules_mapping + load_weights, and a checkpoint
    not quantized otherwise) as `bnb_4bit` says."""
    from lowvram_grpo.settings.model_shapes import VLLM_FAMILIES

    registry = _registry()
    loader = BNB_LOADER.read_text()
    assert 'if not hasattr(model, "packed_modules_mapping"):' in loader
    assert 'if not hasattr(model, "load_weights"):' in loader
    assert 'if quant_method == "bitsandbytes":' in loader and "BitsAndBytes loader does not support" in loader
    for family, serves in VLLM_FAMILIES.items():
        module, cls = registry[serves.model_class]
        assert f"{module}.py" == serves.model_file and cls == serves.model_class, family
        facts = _class_facts(module, cls)
        assert ("SupportsLoRA" in facts["bases"]) == serves.lora, (family, sorted(facts["bases"]))
        loads_bnb = facts["packed"] and facts["load_weights"] and CHECKPOINT_QUANT.get(family) in (None, "bitsandbytes")
        assert loads_bnb == serves.bnb_4bit, family


def test_unsloths_family_lists_are_the_ones_model_shapes_states():
    """unsloth's loader: the families fast_inference cannot share with vLLM, those it runs on vLLM only from sm80;
    unsloth_zoo's FORCE_FLOAT32 matched the way the loader matches it (name with '_' dropped equal, or in
    'model_type,'), for each family's model types."""
    from lowvram_grpo.settings.model_shapes import (UNSLOTH_FORCE_FLOAT32, UNSLOTH_NO_VLLM, UNSLOTH_VLLM_NEEDS_SM80,
                                                    VLLM_FAMILIES)

    assert tuple(_assigned(UNSLOTH_LOADER, "VLLM_UNSUPPORTED_MODEL_TYPES")) == UNSLOTH_NO_VLLM
    assert tuple(_assigned(UNSLOTH_LOADER, "VLLM_NEEDS_SM80_MODEL_TYPES")) == UNSLOTH_VLLM_NEEDS_SM80
    for family, serves in VLLM_FAMILIES.items():
        assert serves.unsloth_vllm == (family not in UNSLOTH_NO_VLLM), family
    force = _assigned(ZOO_MODEL_LISTS, "FORCE_FLOAT32")
    loader = UNSLOTH_LOADER.read_text()
    assert 'disable_name.lower() == model_type_arch.lower().replace("-", "").replace("_", "")' in loader
    assert "or disable_name.lower() in model_types_all" in loader
    for family, types in MODEL_TYPES.items():
        everything = ",".join(types) + ","
        forced = any(name.lower() == t.replace("-", "").replace("_", "") or name.lower() in everything
                     for name in force for t in types)
        assert forced == (family in UNSLOTH_FORCE_FLOAT32), family


def _hf_config(key: str):
    """transformers' config of a KNOWN_SHAPES entry: what unsloth hands load_vllm for that model."""
    import transformers

    from lowvram_grpo.settings.model_shapes import KNOWN_SHAPES

    s = KNOWN_SHAPES[key]
    common = dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                  vocab_size=s.vocab, tie_word_embeddings=s.tied_embeddings, max_position_embeddings=s.context)
    if s.family == "gemma3":
        return transformers.Gemma3TextConfig(**common, sliding_window=s.sliding_window, layer_types=list(s.types))
    return transformers.Qwen3Config(**common)


@pytest.mark.parametrize("key", ["qwen3-4b", "gemma-3-1b"])
def test_vllms_share_and_max_model_len_are_unsloth_zoos_for_q_k_norm_and_sliding_families(key):
    """unsloth_zoo's approximate_vllm_memory_usage + _fit_max_seq_length_to_kv_cache run on the installed source (its
    sliding-window KV count included) against our vllm_budget, on the shapes of the Qwen3 and Gemma 3 presets."""
    import math
    import os
    import re

    import torch
    from test_gpu_wheels import GIB, VLLM_UTILS, _functions

    from lowvram_grpo.settings.model_shapes import KNOWN_SHAPES
    from lowvram_grpo.settings.resolve import vllm_lora_rank
    from lowvram_grpo.settings.unsloth_sizing import vllm_budget

    names = ("_config_get", "_kv_cache_elements_per_token", "_kv_cache_tokens", "vllm_weights_memory_usage",
             "approximate_vllm_memory_usage", "_fit_max_seq_length_to_kv_cache")
    namespace = {"os": os, "torch": torch, "math": math, "re": re}
    exec(_functions(VLLM_UTILS, names), namespace)
    shape, config = KNOWN_SHAPES[key], _hf_config(key)
    weights = {b: namespace["vllm_weights_memory_usage"](config, load_in_4bit=b)
               for b in (True, False)}  # a meta model each

    def sizing(config, free, total, util, max_seq_length, rank, load_in_4bit):  # as test_gpu_wheels', weights once
        namespace["get_mem_info"] = lambda: (free, total)
        tokens, _, actual, _ = namespace["approximate_vllm_memory_usage"](
            config, load_in_4bit=load_in_4bit, max_seq_length=max_seq_length, gpu_memory_utilization=util,
            enable_lora=True, max_lora_rank=rank, max_loras=1, float8_kv_cache=False, account_for_gradients=True,
            weight_bytes=weights[load_in_4bit], max_num_batched_tokens=8192)
        return actual, tokens, namespace["_fit_max_seq_length_to_kv_cache"](max_seq_length, tokens)

    seen_short = seen_full = False
    for total_gib, free_gib in ((14.7, 14.4), (14.7, 9.0), (23.6, 21.6), (23.6, 5.0)):
        free, total = int(free_gib * GIB), int(total_gib * GIB)
        for util in (0.3, 0.5, 0.6, 0.8):
            for length, r in ((1024, 16), (1280, 32), (4096, 64)):
                for four_bit in (True, False):
                    actual, tokens, max_model_len = sizing(config, free, total, util, length, vllm_lora_rank(r),
                                                           four_bit)
                    ours = vllm_budget(shape, util, free, total, length, vllm_lora_rank(r), four_bit)
                    assert ours.utilization == pytest.approx(actual, rel=1e-12), (total_gib, free_gib, util)
                    assert ours.kv_tokens == tokens, (total_gib, free_gib, util, length, four_bit)
                    assert ours.max_model_len == max_model_len
                    seen_short |= max_model_len < length
                    seen_full |= max_model_len == length
    assert seen_full and seen_short
