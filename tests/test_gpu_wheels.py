"""Our models of the pinned GPU wheels' own arithmetic, run against that arithmetic (issue 31 §3, issue 34 §3).

unsloth / unsloth_zoo refuse to import without a GPU: their pure functions are taken out of the installed
source (ast) and executed here, fed the device readings (free and total memory) a card would give, and
compared with what lowvram_grpo computes for the plan and the doctor (lowvram_grpo/unsloth_sizing.py).
TRL imports on CPU: the private GRPOTrainer methods we name are looked up on the real class.

Runs in the GPU install set (requirements.txt); skips elsewhere, and fails when LOWVRAM_GRPO_GPU_SET=1
is set but the set is not installed (the guard of tests/test_gpu_set.py).
"""
from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
from pathlib import Path

import pytest

from conftest import REPO, require_gpu_set

pytestmark = pytest.mark.slow


PINS = require_gpu_set()  # conftest: skips outside the GPU install set, fails there under LOWVRAM_GRPO_GPU_SET=1

SITE = Path(importlib.util.find_spec("vllm").origin).parent.parent
VLLM_UTILS = SITE / "unsloth_zoo" / "vllm_utils.py"
FUSED_LINEAR = SITE / "unsloth_zoo" / "fused_losses" / "fused_linear.py"
GIB = 2 ** 30


def _functions(path: Path, names) -> str:
    text = path.read_text()
    found = {node.name: ast.get_source_segment(text, node) for node in ast.walk(ast.parse(text))
             if isinstance(node, ast.FunctionDef) and node.name in names}
    missing = set(names) - set(found)
    assert not missing, f"{sorted(missing)} not in {path}"
    return "\n\n".join(found[n] for n in names)


def _assignments(path: Path, names) -> str:
    """The module-level `NAME = ...` statements of `names`, as source."""
    text = path.read_text()
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.get_source_segment(text, node)
    missing = set(names) - set(found)
    assert not missing, f"{sorted(missing)} not assigned in {path}"
    return "\n".join(found[n] for n in names)


def _hf_config(shape):
    """transformers' config of the architecture `shape` describes (what unsloth hands load_vllm)."""
    import transformers

    qwen = shape.name.lower().startswith("qwen")
    cls = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    return cls(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
               num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
               tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=shape.context)


def _unsloth_zoo_load_vllm_sizing():
    """unsloth_zoo's approximate_vllm_memory_usage, _fit_max_seq_length_to_kv_cache and vllm_weights_memory_usage,
    executed from the installed source; get_mem_info (torch.cuda.mem_get_info) is the card's reading, given."""
    import torch

    names = ("_config_get", "_kv_cache_elements_per_token", "_kv_cache_tokens", "vllm_weights_memory_usage",
             "approximate_vllm_memory_usage", "_fit_max_seq_length_to_kv_cache")
    namespace = {"os": os, "torch": torch, "math": math, "re": re}
    exec(_functions(VLLM_UTILS, names), namespace)

    def sizing(config, free, total, util, max_seq_length, rank, load_in_4bit):
        namespace["get_mem_info"] = lambda: (free, total)
        tokens, _, actual, kv_gb = namespace["approximate_vllm_memory_usage"](
            config, load_in_4bit=load_in_4bit, max_seq_length=max_seq_length, gpu_memory_utilization=util,
            enable_lora=True, max_lora_rank=rank, max_loras=1, float8_kv_cache=False, account_for_gradients=True,
            weight_bytes=namespace["vllm_weights_memory_usage"](config, load_in_4bit=load_in_4bit),
            max_num_batched_tokens=8192)
        return actual, tokens, namespace["_fit_max_seq_length_to_kv_cache"](max_seq_length, tokens)

    return sizing


def test_load_vllm_is_called_the_way_our_model_of_it_assumes():
    """unsloth's from_pretrained hands load_vllm our max_seq_length, gpu_memory_utilization and max_lora_rank, and
    load_vllm gives vLLM the utilization and length that approximate_vllm_memory_usage and the fit compute."""
    llama = (SITE / "unsloth" / "models" / "llama.py").read_text()
    for line in ("gpu_memory_utilization = gpu_memory_utilization,", "max_seq_length = max_seq_length,",
                 "max_lora_rank = max_lora_rank,", "use_bitsandbytes = load_in_4bit,"):
        assert line in llama, line
    zoo = VLLM_UTILS.read_text()
    assert "free_memory = gpu_memory_utilization * free_memory" in zoo  # a share of the FREE memory
    assert "max_seq_length = _fit_max_seq_length_to_kv_cache(max_seq_length, max_num_batched_tokens)" in zoo
    assert "gpu_memory_utilization = actual_gpu_memory_utilization," in zoo
    assert "max_model_len          = max_seq_length," in zoo


@pytest.mark.parametrize("model", ["unsloth/Meta-Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-3B-Instruct",
                                   "Qwen/Qwen2.5-1.5B-Instruct"])
def test_vllms_share_and_max_model_len_are_unsloth_zoos_run_on_the_installed_source(model):
    """For cards with and without memory taken by a display or another process, every utilization and length the
    presets use: our vllm_budget gives unsloth_zoo's utilization (a share of the FREE memory) and max_model_len
    (exact for Llama; Qwen2's q/k/v biases, which our shapes leave out, may move it by one 256-token block)."""
    from lowvram_grpo.memory import model_shape
    from lowvram_grpo.resolve import vllm_lora_rank
    from lowvram_grpo.unsloth_sizing import vllm_budget

    sizing = _unsloth_zoo_load_vllm_sizing()
    shape = model_shape(model)
    config = _hf_config(shape)
    tolerance = 256 if shape.name.startswith("Qwen") else 0
    seen_short = seen_full = False
    for total_gib, free_gib in ((14.7, 14.4), (14.7, 9.0), (7.6, 7.1), (11.8, 10.3), (23.6, 21.6), (23.6, 5.0)):
        free, total = int(free_gib * GIB), int(total_gib * GIB)
        for util in (0.3, 0.5, 0.6, 0.8, 0.95):
            for length, r in ((1024, 16), (1280, 32), (4096, 64)):
                actual, tokens, max_model_len = sizing(config, free, total, util, length, vllm_lora_rank(r), True)
                ours = vllm_budget(shape, util, free, total, length, vllm_lora_rank(r), True)
                assert ours.utilization == pytest.approx(actual, rel=1e-12), (total_gib, free_gib, util)
                assert abs(ours.kv_tokens - tokens) <= tolerance, (total_gib, free_gib, util, length)
                assert abs(ours.max_model_len - max_model_len) <= tolerance, (total_gib, free_gib, util, length)
                seen_short |= max_model_len < length
                seen_full |= max_model_len == length
    assert seen_short and seen_full  # both sides of the shrink were compared


def test_our_unsloth_weight_estimate_is_unsloth_zoos_meta_device_count():
    from lowvram_grpo.memory import model_shape
    from lowvram_grpo.unsloth_sizing import unsloth_weight_bytes

    import torch

    namespace = {"os": os, "torch": torch}
    exec(_functions(VLLM_UTILS, ("vllm_weights_memory_usage",)), namespace)
    for model in ("unsloth/Meta-Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"):
        shape = model_shape(model)
        for four_bit in (True, False):
            theirs = namespace["vllm_weights_memory_usage"](_hf_config(shape), load_in_4bit=four_bit)
            assert unsloth_weight_bytes(shape, four_bit) == pytest.approx(theirs, rel=2e-4), (model, four_bit)


def test_our_logprob_chunk_rows_are_unsloth_zoos_fused_linear_rows():
    """unsloth_zoo.fused_losses.fused_linear.fused_linear_rows with its module constants, from the source."""
    from lowvram_grpo.unsloth_sizing import fused_linear_rows

    namespace = {"os": os, "math": math}
    exec(_functions(FUSED_LINEAR, ("_env_float", "_pow2", "fused_linear_rows")), namespace)
    exec(_assignments(FUSED_LINEAR, ("_CHUNK_GB", "_MIN_LOGITS", "_MIN_ROWS", "_MAX_ROWS")), namespace)
    for budget_gib in (namespace["_CHUNK_GB"], 0.4, 1.3):
        budget = max(int(budget_gib * 1024 ** 3), 1)
        namespace["_budget_bytes"] = lambda device, budget=budget: budget
        for vocab in (512, 49152, 128256, 151936):
            for hidden in (64, 1536, 2048, 4096):
                for n_rows in (1, 3, 100, 511, 2048, 4096, 8 * 1280, 16 * 1280):
                    assert fused_linear_rows(n_rows, hidden, vocab, budget) == \
                        namespace["fused_linear_rows"](n_rows, hidden, vocab), (n_rows, hidden, vocab, budget)
