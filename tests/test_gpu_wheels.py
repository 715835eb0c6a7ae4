"""Our models of the pinned GPU wheels' own arithmetic, run against that arithmetic (issue 31 §3, issue 34 §3).

unsloth / unsloth_zoo refuse to import without a GPU: their pure functions are taken out of the installed
source (ast) and executed here, fed the device readings (free and total memory) a card would give, and
compared with what lowvram_grpo computes for the plan and the doctor (lowvram_grpo/settings/unsloth_sizing.py).
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

    def sizing(config, free, total, util, max_seq_length, rank, load_in_4bit, float8_kv_cache=False):
        namespace["get_mem_info"] = lambda: (free, total)
        tokens, _, actual, kv_gb = namespace["approximate_vllm_memory_usage"](
            config, load_in_4bit=load_in_4bit, max_seq_length=max_seq_length, gpu_memory_utilization=util,
            enable_lora=True, max_lora_rank=rank, max_loras=1, float8_kv_cache=float8_kv_cache,
            account_for_gradients=True,
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
    from lowvram_grpo.settings.model_shapes import model_shape
    from lowvram_grpo.settings.resolve import vllm_lora_rank
    from lowvram_grpo.settings.unsloth_sizing import vllm_budget

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


@pytest.mark.parametrize("model", ["unsloth/Meta-Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"])
def test_with_an_fp8_kv_cache_vllms_length_is_unsloth_zoos_and_the_plans_kv_term_halves(model):
    """model.kv_cache_dtype=fp8 (from_pretrained float8_kv_cache=True): unsloth_zoo's approximate_vllm_memory_usage
    counts 1.25 bytes a KV element, so the tokens in the same share and the max_model_len it starts vLLM with are ours
    with float8_kv_cache (unsloth_sizing.vllm_budget); the share itself does not move. The plan's own KV term (vLLM's
    fp8 cache: 1 byte an element) is half the 16-bit one: memory_plan_terms via Resolved.kv_bytes."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.memory_terms import estimate
    from lowvram_grpo.settings.model_shapes import model_shape
    from lowvram_grpo.settings.resolve import resolve, vllm_lora_rank
    from lowvram_grpo.settings.unsloth_sizing import vllm_budget

    sizing = _unsloth_zoo_load_vllm_sizing()
    shape = model_shape(model)
    config = _hf_config(shape)
    tolerance = 256 if shape.name.startswith("Qwen") else 0
    grew = 0
    for total_gib, free_gib in ((23.6, 21.6), (23.6, 5.0), (11.8, 10.3), (7.6, 7.1)):
        free, total = int(free_gib * GIB), int(total_gib * GIB)
        for util in (0.3, 0.6, 0.9):
            for length in (1024, 4096, 16384):
                rank = vllm_lora_rank(32)
                actual, tokens, max_model_len = sizing(config, free, total, util, length, rank, True, True)
                ours = vllm_budget(shape, util, free, total, length, rank, True, float8_kv_cache=True)
                sixteen = vllm_budget(shape, util, free, total, length, rank, True)
                assert ours.utilization == pytest.approx(actual, rel=1e-12) == sixteen.utilization
                assert abs(ours.kv_tokens - tokens) <= tolerance, (total_gib, free_gib, util, length)
                assert abs(ours.max_model_len - max_model_len) <= tolerance, (total_gib, free_gib, util, length)
                grew += ours.max_model_len > sixteen.max_model_len
    assert grew  # somewhere fp8 let unsloth start vLLM with a longer max_model_len
    name = "llama8b_4bit" if "Llama" in model else "qwen1_5b_4bit"
    # an H100: vLLM 0.31 serves an fp8 KV cache there with FlashInfer off (FlashAttention 3); on an RTX 4090 without
    # FlashInfer resolve refuses it (resolve.fp8_kv_refusal, tests/test_gpu_defects.py)
    plans = [estimate(r, r.vram_gib) for r in (resolve(load_config(name, [f"model.kv_cache_dtype={kv}"]),
                                                       profile("h100-80gb"))
                                               for kv in ("bfloat16", "fp8"))]
    assert plans[0].kv_needed_bytes == 2 * plans[1].kv_needed_bytes


def test_our_unsloth_weight_estimate_is_unsloth_zoos_meta_device_count():
    from lowvram_grpo.settings.model_shapes import model_shape
    from lowvram_grpo.settings.unsloth_sizing import unsloth_weight_bytes

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
    from lowvram_grpo.settings.unsloth_sizing import fused_linear_rows

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


# --------------------------------------------------------------------------- the T4 (sm75) path with fast_inference

RL_REPLACEMENTS = SITE / "unsloth" / "models" / "rl_replacements.py"


def test_unsloth_asks_for_flashinfers_sampler_below_sm80_which_vllm_refuses_and_its_switch_keeps_it_off():
    """resolve.FLASHINFER_MIN_COMPUTE_CAPABILITY / NO_FLASHINFER_ENV, read against the pinned wheels: unsloth_zoo's
    load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 on cards below sm80 (vllm >= 0.11); vLLM 0.31's FlashInfer excludes
    sm75 and, with the variable set, raises at load; UNSLOTH_VLLM_NO_FLASHINFER=1 sets the sampler variable to 0."""
    from lowvram_grpo.settings.resolve import FLASHINFER_MIN_COMPUTE_CAPABILITY, NO_FLASHINFER_ENV

    # FlashInferBackend imports CUDA at import time: its supports_compute_capability read from the source
    backend = (SITE / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py").read_text()
    supports = backend[backend.index("def supports_compute_capability"):]
    floor = re.search(r"return capability >= DeviceCapability\((\d+), (\d+)\)", supports[:1200])
    assert floor and (int(floor.group(1)), int(floor.group(2))) == FLASHINFER_MIN_COMPUTE_CAPABILITY > (7, 5)
    load = _functions(VLLM_UTILS, ["load_vllm"])
    switch = re.search(r'_no_flashinfer = os\.environ\.get\("(\w+)", "0"\) != "0"', load)
    assert switch and switch.group(1) == NO_FLASHINFER_ENV
    off = load[load.index("elif _no_flashinfer:"):load.index('elif importlib.util.find_spec("flashinfer"):')]
    assert 'os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"' in off
    below = re.search(r'if major_version >= 8:\n\s+os\.environ\["VLLM_USE_FLASHINFER_SAMPLER"\] = "1"\n'
                      r'\s+elif Version\(vllm_version\) >= Version\("0\.11\.0"\):\n(?:\s+#.*\n)*'
                      r'\s+os\.environ\["VLLM_USE_FLASHINFER_SAMPLER"\] = "1"', load)
    assert below, "unsloth_zoo no longer forces the FlashInfer sampler below sm80: resolve's decision may be dropped"
    sampler = (SITE / "vllm" / "v1" / "sample" / "ops" / "topk_topp_sampler.py").read_text()
    assert 'if envs.is_set("VLLM_USE_FLASHINFER_SAMPLER"):\n        raise RuntimeError(' in sampler
    assert ("if not envs.VLLM_USE_FLASHINFER_SAMPLER:\n        logger.info_once("
            in sampler)  # 0: no FlashInfer, no raise


def test_from_sm80_unsloth_asks_for_flashinfer_whenever_nvcc_exists_and_our_switch_comes_first():
    """resolve.choose_flashinfer, read against the pinned load_vllm (unsloth_zoo/vllm_utils.py ~4664-4757): its
    FlashInfer probe checks only that nvcc, ninja and libcuda exist (no `nvcc --version`, no CUDA release against
    torch's), then from sm80 sets VLLM_USE_FLASHINFER_SAMPLER=1, so FlashInfer JIT-compiles with whatever nvcc is
    found; UNSLOTH_VLLM_NO_FLASHINFER is read before that probe and, set, turns the sampler off and hides FlashInfer's
    import, so resolve's decision holds on every card."""
    from lowvram_grpo.settings.resolve import NO_FLASHINFER_ENV

    load = _functions(VLLM_UTILS, ["load_vllm"])
    switch = load.index(f'_no_flashinfer = os.environ.get("{NO_FLASHINFER_ENV}", "0") != "0"')
    off, probe = load.index("elif _no_flashinfer:"), load.index('elif importlib.util.find_spec("flashinfer"):')
    assert switch < off < probe
    kept_off = load[off:probe]
    assert 'os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"' in kept_off and "_block_flashinfer_import()" in kept_off
    decided = load[probe:load.index("else:\n            # Not installed", probe)]
    checks = decided[:decided.index("if not _has_nvcc or not _has_ninja or not _can_link:")]
    assert 'shutil.which("nvcc") is not None' in checks and 'shutil.which("ninja") is not None' in checks
    assert "_can_link_libcuda()" in checks
    assert "--version" not in checks and "release" not in checks and "torch.version.cuda" not in checks, \
        "unsloth_zoo now reads nvcc's CUDA release: resolve.choose_flashinfer may defer to it"
    sm80 = re.search(r'# Flashinfer sampler maybe makes it somewhat faster on newer GPUs\n(?:\s+#.*\n)*'
                     r'\s+if major_version >= 8:\n\s+os\.environ\["VLLM_USE_FLASHINFER_SAMPLER"\] = "1"', decided)
    assert sm80, ("unsloth_zoo no longer forces the FlashInfer sampler from sm80: resolve.choose_flashinfer may be "
                  "dropped")
    link = _functions(VLLM_UTILS, ["_can_link_libcuda"])
    assert "--version" not in link and "release" not in link  # a file's presence, not its CUDA release


def test_a_failure_inside_unsloths_vllm_start_is_one_line_and_other_load_errors_stay_as_they_are(tmp_path):
    """The exception the real load_vllm raises where nothing is injected (on this CPU: its "vLLM is required"
    ImportError, as unsloth's import blocked the vLLM whose CUDA kernels cannot load here) becomes EngineStopped's one
    line with the way on; a model loader's own error does not. The T4's FlashInfer RuntimeError: the tests below."""
    import unsloth  # noqa: F401  (before unsloth_zoo, as the backend imports it)
    from transformers import AutoConfig
    from unsloth_zoo.vllm_utils import load_vllm

    from lowvram_grpo.model.unsloth_backend import VLLM_START_FRAME, engine_did_not_start, vllm_start_failure
    from lowvram_grpo.model.builtin_models import resolve_model_path
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.core.errors import EngineStopped
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import resolve

    assert load_vllm.__name__ == VLLM_START_FRAME[1] and VLLM_START_FRAME[0] in load_vllm.__module__
    path = resolve_model_path("builtin:tiny")
    with pytest.raises(Exception) as raised:
        load_vllm(model_name=path, config=AutoConfig.from_pretrained(path), gpu_memory_utilization=0.5,
                  max_seq_length=512, enable_lora=True, max_lora_rank=16)
    cause = vllm_start_failure(raised.value)
    assert cause and cause.startswith(type(raised.value).__name__ + ": ") and "\n" not in cause
    resolved = resolve(load_config("qwen1_5b_4bit", []), profile("t4"), "unsloth")
    error = engine_did_not_start(resolved, cause)
    assert isinstance(error, EngineStopped) and "\n" not in str(error)
    assert "on Tesla T4" in str(error) or "(sm75)" in str(error)
    assert "--set model.fast_inference=false" in str(error) and "nothing is written yet" in str(error)
    with pytest.raises(OSError) as other:  # the model's own loading: not the engine's
        AutoConfig.from_pretrained(str(tmp_path / "no-model"))
    assert vllm_start_failure(other.value) is None


SM75_START = REPO / "tests" / "sm75_vllm_start.py"
# What tests/sm75_vllm_start.py injects, each named there with why a CPU lacks it: a new one must be added here too.
SM75_INJECTED = ["vllm._C_stable_libtorch", "torch.cuda readings", "unsloth_zoo DEVICE_TYPE", "vllm current_platform",
                 "vllm HAS_TRITON", "CUDA toolkit layout", "vllm.LLM", "unsloth GPU loader"]
SAMPLER_SOURCE = os.path.join("vllm", "v1", "sample", "ops", "topk_topp_sampler.py")
FLASHINFER_ON_SM75 = ("FlashInfer top-p/top-k sampling unavailable: unsupported compute capability 7.5. "
                      "Unset VLLM_USE_FLASHINFER_SAMPLER=1.")


def _sm75_start(mode: str) -> dict:
    """tests/sm75_vllm_start.py MODE in a process of its own (its injections precede unsloth's import), without the
    two FlashInfer variables of this environment: the load decides them."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("UNSLOTH_VLLM_NO_FLASHINFER", "VLLM_USE_FLASHINFER_SAMPLER")}
    proc = subprocess.run([sys.executable, str(SM75_START), mode], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(results[-1][len("RESULT "):])
    assert result["injected"] == SM75_INJECTED
    return result


def test_on_a_t4_without_our_switch_the_real_load_vllm_fails_on_vllms_flashinfer_check_and_the_run_stops_in_one_line():
    """Our load_model, the pinned load_vllm and vLLM 0.31's code, on a CPU with a T4's readings injected (what and why:
    tests/sm75_vllm_start.py): without UNSLOTH_VLLM_NO_FLASHINFER, load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 for
    sm75, vLLM's config picks Model Runner V2, whose sampler check raises vLLM's RuntimeError from its own source;
    load_vllm re-raises it, and load_model turns it into EngineStopped's one line naming the cause and the way on."""
    result = _sm75_start("bypassed")
    assert result["engine_environment"] == {} and result["outcome"] == "EngineStopped"
    seen = result["seen"]
    assert seen["sampler_env"] == "1" and seen["capability"] == "7.5"  # what load_vllm set; vLLM's CUDA platform
    assert seen["v2"] is True and seen["logprobs_mode"] == "processed_logprobs"  # V1 would skip FlashInfer's check
    assert "flashinfer" not in seen  # the check raised
    vllm_raised = result["vllm_raised"]
    assert vllm_raised["type"] == "RuntimeError" and vllm_raised["message"] == FLASHINFER_ON_SM75
    assert vllm_raised["file"].endswith(SAMPLER_SOURCE) and vllm_raised["function"] == "flashinfer_sampler_supported"
    unsloth_raised = result["load_vllm_raised"]
    assert unsloth_raised["type"] == "RuntimeError" and unsloth_raised["message"] == FLASHINFER_ON_SM75
    assert (unsloth_raised["file"].endswith(os.path.join("unsloth_zoo", "vllm_utils.py"))
            and unsloth_raised["function"] == "load_vllm")
    error = result["error"]
    assert "\n" not in error
    assert error.startswith("unsloth could not start vLLM for model.fast_inference on Tesla T4 (sm75): RuntimeError: "
                            + FLASHINFER_ON_SM75 + "; ")
    assert ("unsloth_zoo's load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 itself, so unsetting it does not help: set "
            "UNSLOTH_VLLM_NO_FLASHINFER=1 in the environment to keep vLLM's FlashInfer off") in error
    assert "nothing is written yet" in error and "--set model.fast_inference=false" in error


def test_with_resolves_t4_decision_the_real_load_vllm_keeps_flashinfers_sampler_off_and_vllm_does_not_raise():
    """The same load as a T4 run has it: resolve's UNSLOTH_VLLM_NO_FLASHINFER=1 reaches the pinned load_vllm through
    load_model, which sets VLLM_USE_FLASHINFER_SAMPLER=0; vLLM's sampler check then declines FlashInfer without
    raising, and the engine stand-in gets past the point where the load failed above."""
    result = _sm75_start("kept")
    assert result["engine_environment"] == {"UNSLOTH_VLLM_NO_FLASHINFER": "1"}
    assert result["outcome"] == "engine built", result
    seen = result["seen"]
    assert seen["sampler_env"] == "0" and seen["capability"] == "7.5" and seen["v2"] is True
    assert seen["flashinfer"] is False


VLLM_ERROR = """
import torch
from vllm import SamplingParams
from lowvram_grpo.model.unsloth_backend import vllm_engine_failure
try:
    SamplingParams(n=0)  # vLLM's own validation, raised from vllm/sampling_params.py
except Exception as exc:
    print(vllm_engine_failure(exc))
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory.")  # the same place, as CUDA's allocator error
    oom.__traceback__ = exc.__traceback__
    print(vllm_engine_failure(oom))
print(vllm_engine_failure(ValueError("not from vLLM")))
"""


def test_an_error_raised_in_vllms_code_is_the_engines_and_an_out_of_memory_is_left_to_the_memory_line():
    """In a process of its own: importing unsloth on a CPU turns vLLM's imports off for the rest of the process."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", VLLM_ERROR], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine, oom, other = proc.stdout.strip().splitlines()[-3:]
    assert " in vLLM: " in engine and "n" in engine and oom == "None" and other == "None", proc.stdout


def test_unsloths_rollout_lora_folder_is_the_one_we_move_into_the_run(tmp_path, monkeypatch):
    """unsloth writes `vllm_gen_lora` (+ _CUDA_VISIBLE_DEVICES) relative to the working directory on the first
    rollout (rl_replacements.py; unsloth_zoo's _live_lora_config saves the adapter config there): the run moves it."""
    from lowvram_grpo.model.unsloth_backend import rollout_files_moved_to, rollout_lora_dir

    source = RL_REPLACEMENTS.read_text()
    assert 'lora_name = "vllm_gen_lora"' in source
    assert 'lora_name += "_" + os.environ.get("CUDA_VISIBLE_DEVICES", "0").replace(",", "")' in source
    assert "config.save_pretrained(save_directory)" in _functions(VLLM_UTILS, ["_live_lora_config"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert rollout_lora_dir() == Path("vllm_gen_lora_0")
    run = tmp_path / "run"
    run.mkdir()
    with rollout_files_moved_to(run):
        (tmp_path / "vllm_gen_lora_0").mkdir()
        (tmp_path / "vllm_gen_lora_0" / "adapter_config.json").write_text("{}")
    assert not (tmp_path / "vllm_gen_lora_0").exists() and (run / "vllm_gen_lora_0" / "adapter_config.json").is_file()
    (tmp_path / "vllm_gen_lora_0").mkdir()  # one that was there before the run is left alone
    with rollout_files_moved_to(run):
        pass
    assert (tmp_path / "vllm_gen_lora_0").is_dir()


# --------------------------------------------------------------------------- issue 54: the levers resolve decides

UNSLOTH = SITE / "unsloth" / "models"
ZOO_RL = SITE / "unsloth_zoo" / "rl_replacements.py"


def test_unsloths_importance_sampling_correction_is_off_by_default_and_our_flag_and_mode_reach_its_loss():
    """resolve.choose_is_correction sets GRPOConfig(vllm_importance_sampling_correction, vllm_importance_sampling_mode)
    and, on unsloth's engine, UNSLOTH_GRPO_VLLM_IS_MODE. The pinned lines that make this the correction that runs:
    unsloth's GRPOConfig default off (rl.py), TRL's own computation disabled and the rollout log-probs handed on under
    the flag (rl_replacements.py), its compute_loss passing them to unsloth_zoo's grpo_accumulated_loss, which reads
    the trainer's flag and the config's mode (overridden by the variable) into grpo_compute_loss, where the ratio
    multiplies the loss; the sampling/* metrics are logged under the same flag."""
    from lowvram_grpo.settings.resolve import IS_MODE, IS_MODE_ENV, IS_MODE_VESPO

    rl = (UNSLOTH / "rl.py").read_text()
    assert '"vllm_importance_sampling_correction": False,' in rl  # unsloth's default: what auto overrides
    replacements = (UNSLOTH / "rl_replacements.py").read_text()
    assert ('replacement_string = "if False and self.use_vllm and self.vllm_importance_sampling_correction:"'
            in replacements)
    assert ('if self.use_vllm and getattr(self, "vllm_importance_sampling_correction", False):\n'
            '                output["sampling_per_token_logps"] = sampling_per_token_logps') in replacements
    assert 'sampling_per_token_logps = inputs.get("sampling_per_token_logps", None)' in replacements
    assert "sampling_per_token_logps = sampling_per_token_logps," in replacements  # into grpo_accumulated_loss
    logged = replacements[replacements.index(
        '(self.use_vllm and getattr(self, "vllm_importance_sampling_correction", False))'):]
    for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max"):
        assert f'self._metrics[mode]["{key}"]' in logged[:4000], key
    accumulated = _functions(ZOO_RL, ["grpo_accumulated_loss"])
    assert 'getattr(trainer, "vllm_importance_sampling_correction", False)' in accumulated  # the rollout log-probs kept
    assert ('kwargs["vllm_importance_sampling_mode"] = getattr(trainer.args, "vllm_importance_sampling_mode", None) '
            'or "token_truncate"') in accumulated
    override = re.search(r'if os\.environ\.get\("(\w+)", ""\):\n\s+kwargs\["vllm_importance_sampling_mode"\] = '
                         r'os\.environ\["(\w+)"\]', accumulated)
    assert override and override.group(1) == override.group(2) == IS_MODE_ENV
    modes = re.search(r'kwargs\["vllm_importance_sampling_mode"\] not in \(\s*([^)]*)\)', accumulated)
    assert modes and {IS_MODE, IS_MODE_VESPO} <= set(re.findall(r'"(\w+)"', modes.group(1)))
    assert ('kwargs["vllm_importance_sampling_correction"] = '
            'getattr(trainer, "vllm_importance_sampling_correction", False)') \
        in accumulated and 'kwargs["use_vllm"] = trainer.use_vllm' in accumulated
    compute = _functions(ZOO_RL, ["grpo_compute_loss"])
    assert 'vllm_importance_sampling_correction = kwargs.get("vllm_importance_sampling_correction", False)' in compute
    applied = compute[compute.rindex(
        "if use_vllm and sampling_per_token_logps is not None and vllm_importance_sampling_correction:"):]
    assert "loss_i = loss_i * importance_sampling_ratio" in applied[:400]
    assert 'if vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]:' in compute


def test_unsloths_decode_graphs_cover_the_model_types_resolve_names_under_the_switches_it_names():
    """resolve.choose_decode_graphs / DECODE_GRAPH_MODEL_TYPES / DECODE_GRAPHS_ENV and internals.decode_graph_stats,
    against unsloth/models/_decode_graphs.py: the private set of model types (a literal), the environment switch and
    its default (inside an RL trainer's generate on NVIDIA CUDA), rl.py's generate wrapped in that scope, the stats'
    keys and where the state lives; and the lines docs/gpu.md cites for qwen2 (the Llama decode path, its biases)."""
    from lowvram_grpo.settings.resolve import DECODE_GRAPH_MODEL_TYPES, DECODE_GRAPHS_ENV
    from lowvram_grpo.core.internals import DECODE_GRAPH_COUNTERS, DECODE_GRAPHS_MODULE, DECODE_GRAPHS_STATE

    path = UNSLOTH / "_decode_graphs.py"
    text = path.read_text()
    assert DECODE_GRAPHS_MODULE == "unsloth.models._decode_graphs"
    types = [node for node in ast.parse(text).body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "_SUPPORTED_MODEL_TYPES" for t in node.targets)]
    assert len(types) == 1 and ast.literal_eval(types[0].value) == set(DECODE_GRAPH_MODEL_TYPES)
    enabled = _functions(path, ["enabled"])
    assert f'flag = os.environ.get("{DECODE_GRAPHS_ENV}", "")' in enabled
    assert 'if flag == "1":\n        return True\n    if flag == "0":\n        return False' in enabled
    assert 'return _DEFAULT_OK and getattr(_TLS, "rl_depth", 0) > 0' in enabled
    assert "return torch.version.hip is None and torch.cuda.is_available()" in _functions(path, ["_default_ok"])
    assert 'PREALLOC = os.environ.get("UNSLOTH_DECODE_GRAPH_PREALLOC", "0") == "1"' in text  # the kit records it
    assert "with _decode_graphs.rl_generation():\n                    out = original_generate(*args, **kwargs)" in \
        (UNSLOTH / "rl.py").read_text()
    stats = _functions(path, ["stats"])
    assert f'state = getattr(model, "__dict__", {{}}).get("{DECODE_GRAPHS_STATE}")' in stats
    assert set(re.findall(r'"(\w+)": (?:len\()?state\.', stats)) == set(DECODE_GRAPH_COUNTERS) | {"disabled"}
    assert f'state = module.__dict__.get("{DECODE_GRAPHS_STATE}")' in _functions(path, ["_states"])  # on inner modules
    # qwen2 (docs/gpu.md): excluded only by the set; it runs Llama's decode path, whose attention is graph-ready
    assert "# Tested families only (Qwen2 shares the Llama attention but is untested here)." in text
    qwen2 = (UNSLOTH / "qwen2.py").read_text()
    assert "Qwen2ForCausalLM.forward = CausalLM_fast_forward(LlamaModel_fast_forward_inference)" in qwen2
    assert ("_decode_graphs.register_attention(LlamaAttention_fast_forward_inference)"
            in (UNSLOTH / "llama.py").read_text())
    linear = (SITE / "unsloth" / "kernels" / "utils.py").read_text()
    assert "    if bias is not None:\n        out += bias" in linear[linear.index("def fast_linear_forward("):]


def test_the_stats_door_reads_the_installed_module():
    """internals.decode_graph_stats on a real module tree: the installed unsloth's `stats` sums the counters of the
    modules holding a graph state ({} for a model that never decoded with graphs, as on a CPU)."""
    import torch

    import unsloth  # noqa: F401  (before unsloth_zoo / unsloth.models, as the backend imports it)
    from unsloth.models import _decode_graphs

    from lowvram_grpo.core.internals import (decode_graph_stats, describe_decode_graphs, missing_decode_graph_stats)

    assert missing_decode_graph_stats() == []  # what unsloth_backend.prepare checks
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert decode_graph_stats(model) == {}
    inner = _decode_graphs._state(model[1])  # what unsloth's decode_step creates on the CausalLM it runs on
    inner.captures, inner.replays, inner.eager_steps = 2, 30, 3
    inner.graphs[(1,)] = object()
    assert decode_graph_stats(model) == {"captures": 2, "replays": 30, "graphs": 1, "eager_steps": 3, "disabled": None}
    assert describe_decode_graphs(decode_graph_stats(model), True) == \
        "unsloth decode CUDA graphs: 2 captures, 30 replays, 3 eager steps (decided on)"


def test_float8_kv_cache_is_a_from_pretrained_parameter_that_load_vllm_turns_into_vllms_fp8_cache():
    """resolve.choose_kv_cache_dtype / FP8_KV_MIN_COMPUTE_CAPABILITY and unsloth_backend.from_pretrained_kwargs against
    the pinned source: FastLanguageModel.from_pretrained takes float8_kv_cache and hands it to load_vllm, which refuses
    it below sm80, starts vLLM with kv_cache_dtype="fp8", and sizes with 1.25 bytes an element (unsloth_sizing)."""
    from lowvram_grpo.settings.resolve import FP8_KV_MIN_COMPUTE_CAPABILITY
    from lowvram_grpo.settings.unsloth_sizing import FP8_KV_ELEMENT_BYTES, KV_ELEMENT_BYTES

    loader = (UNSLOTH / "loader.py").read_text()
    language = loader[loader.index("class FastLanguageModel"):]
    head = language[language.index("def from_pretrained("):]
    assert "float8_kv_cache = False," in head[:head.index("):")] and "float8_kv_cache = float8_kv_cache," in head
    llama = (UNSLOTH / "llama.py").read_text()
    assert "float8_kv_cache = float8_kv_cache," in llama[llama.index("load_vllm"):]
    load = _functions(VLLM_UTILS, ["load_vllm"])
    floor = re.search(r"if float8_kv_cache and major_version < (\d+):", load)
    assert floor and (int(floor.group(1)), 0) == FP8_KV_MIN_COMPUTE_CAPABILITY
    assert 'kv_cache_dtype         = "fp8" if float8_kv_cache else "auto",' in load
    sizing = _functions(VLLM_UTILS, ["approximate_vllm_memory_usage"])
    assert f"float_bytes = {FP8_KV_ELEMENT_BYTES} if float8_kv_cache else {KV_ELEMENT_BYTES}" in sizing


# --------------------------------------------------------------------------- the pinned wheels' CUDA (issue 49)
# lowvram_grpo/driver_fit.SETS says which CUDA requirements.txt's torch and vLLM are built for (and so which driver the
# set needs, and that a CUDA 12 driver gets requirements-cuda12.txt instead). Read here from the wheels themselves:
# a pin bump that changes their CUDA fails until driver_fit (and requirements-cuda12.txt) follow it.

def _elf_needed(path: Path) -> list[str]:
    """The libraries an ELF64 little-endian shared object links (DT_NEEDED of its dynamic section), as `readelf -d`."""
    import mmap
    import struct

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not an ELF64 little-endian object"
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        # section headers: name, type, flags, addr, offset, size, link, info, addralign, entsize
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        needed = []
        for section in sections:
            if section[1] != 6:  # SHT_DYNAMIC
                continue
            strings = sections[section[6]][4]  # its string table's offset
            for offset in range(section[4], section[4] + section[5], 16):
                tag, value = struct.unpack_from("<qQ", data, offset)
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED
                    start = strings + value
                    needed.append(data[start:data.find(b"\0", start)].decode())
        return needed


def _cuda_extras(requires: list[str]) -> dict[str, set[int]]:
    """{distribution: CUDA majors of its cuNN extras} of a Requires-Dist list (nvidia-cutlass-dsl[cu13] -> {13})."""
    from packaging.requirements import Requirement

    found = {}
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        majors = {int(extra[2:]) for extra in requirement.extras if re.fullmatch(r"cu\d+", extra)}
        if majors:
            found[requirement.name] = majors
    return found


def test_the_pinned_vllm_is_built_for_the_cuda_driver_fit_says():
    """vllm 0.31.0's installed wheel: its Requires-Dist asks for CUDA 13 builds (nvidia-cutlass-dsl[cu13],
    humming-kernels[cu13]) and its compiled kernels link libcudart.so.13; driver_fit.SETS[13] says CUDA 13."""
    import importlib.metadata

    from lowvram_grpo.settings.driver_fit import SETS, build_major

    pinned = SETS[13]
    dist = importlib.metadata.distribution("vllm")
    assert dist.version == PINS["vllm"] == pinned.vllm
    extras = _cuda_extras(dist.requires or [])
    assert "nvidia-cutlass-dsl" in extras and set().union(*extras.values()) == {pinned.vllm_cuda}, extras
    cudart = {}
    for library in sorted((SITE / "vllm").glob("*.so")):
        for name in _elf_needed(library):
            if name.startswith("libcudart.so."):
                cudart[library.name] = int(name.rsplit(".", 1)[1])
    assert cudart and set(cudart.values()) == {pinned.vllm_cuda}, cudart
    assert build_major(dist.version, pinned.vllm_cuda) == pinned.vllm_cuda  # no local label: the PyPI (CUDA 13) build


def _pypi_wheel_metadata(name: str, filename: str) -> str:
    """The METADATA of one wheel file on PyPI, from its PEP 658 `.metadata` file (the wheel itself is not fetched):
    torch's wheel is ~900 MB, and the GPU set's venv holds its CPU build, whose metadata names no CUDA."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    from pinned_wheels import RegistryUnreachable, registry_required

    cert = os.environ.get("PIP_CERT")
    context = ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()
    try:
        index = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                       headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(index, timeout=60, context=context) as answer:
            files = {f["filename"]: f for f in json.load(answer)["files"]}
        assert filename in files, f"PyPI has no {filename}"
        with urllib.request.urlopen(files[filename]["url"] + ".metadata", timeout=60, context=context) as answer:
            return answer.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        if registry_required():
            raise RegistryUnreachable(f"PyPI could not be reached: {exc}") from None
        pytest.skip(f"PyPI could not be reached: {exc}")


def test_the_pinned_torch_is_built_for_the_cuda_driver_fit_says():
    """torch 2.13.0's PyPI wheel for the GPU target (the one requirements.txt installs there): its Requires-Dist asks
    for CUDA 13.0 (cuda-toolkit==13.0.x, nvidia-*-cu13); driver_fit.SETS[13] says CUDA 13, and the CUDA 12 set's torch
    is the same version with a +cu12x label."""
    from email.parser import Parser

    from lowvram_grpo.settings.driver_fit import SETS, build_major

    pinned = SETS[13]
    assert PINS["torch"] == pinned.torch and SETS[12].torch.split("+")[0] == pinned.torch
    metadata = Parser().parsestr(_pypi_wheel_metadata("torch",
                                                      f"torch-{pinned.torch}-cp311-cp311-manylinux_2_28_x86_64.whl"))
    requires = metadata.get_all("Requires-Dist") or []
    linux = [r for r in requires if "extra ==" not in r]
    toolkit = [r for r in linux if r.startswith("cuda-toolkit")]
    assert toolkit and all(re.search(rf"=={pinned.torch_cuda}\.\d", r) for r in toolkit), toolkit
    suffixed = {m.group(1) for r in linux if (m := re.match(r"nvidia-[\w-]+?-cu(\d+)\b", r))}
    assert suffixed == {str(pinned.torch_cuda)}, linux
    assert build_major(pinned.torch, pinned.torch_cuda) == pinned.torch_cuda
    assert build_major(SETS[12].torch, None) == SETS[12].torch_cuda == 12


def test_the_cuda12_set_swaps_in_the_versions_the_pinned_vllm_requires():
    """requirements-cuda12.txt's torch, torchvision and torchaudio (their +cu129 builds) are the versions vllm 0.31.0
    pins (its Requires-Dist), and its vLLM is that version's +cu129 build: a vLLM pin bump fails until it follows."""
    import importlib.metadata

    from packaging.requirements import Requirement

    from lowvram_grpo.doctor import read_pins
    from lowvram_grpo.settings.driver_fit import SETS

    wanted = {}
    for text in importlib.metadata.distribution("vllm").requires or []:
        requirement = Requirement(text)
        if requirement.name in ("torch", "torchvision", "torchaudio") and requirement.marker is None:
            (spec,) = requirement.specifier
            wanted[requirement.name] = spec.version
    cuda12 = read_pins(REPO / SETS[12].file)
    assert wanted.keys() == {"torch", "torchvision", "torchaudio"}, wanted
    assert {name: cuda12[name] for name in wanted} == {name: f"{version}+cu129" for name, version in wanted.items()}
    assert cuda12["vllm"] == f"{PINS['vllm']}+cu129" == SETS[12].vllm
