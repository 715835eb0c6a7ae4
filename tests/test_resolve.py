"""resolve(config, hardware): every device-dependent decision, for every preset on every card profile.

Pure: no GPU needed, no torch imported by resolve itself. The profiles are what users train on
(hardware.PROFILES); the T4 cases are the ones that crashed or misled on a first real run."""
import dataclasses

import pytest

from lowvram_grpo.settings.config import list_presets, load_config
from lowvram_grpo.settings.hardware import ANY_GPU, PROFILES, Hardware, UnknownProfile, profile
from lowvram_grpo.settings.resolve import ResolveError, follow_loaded_dtype, resolve

GPU_PROFILES = [name for name, hw in PROFILES.items() if hw.cuda]
# GRPOConfig's (bf16, fp16) for each compute dtype on a CUDA card, written out (on a CPU: neither)
CUDA_PRECISION = {"bfloat16": (True, False), "float16": (False, True), "float32": (False, False)}


@pytest.mark.parametrize("hw_name", list(PROFILES))
@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_resolves_on_every_profile(preset, hw_name):
    config, hw = load_config(preset), PROFILES[hw_name]
    if config.requires_cuda and not hw.cuda:
        with pytest.raises(ResolveError, match="needs an NVIDIA GPU"):
            resolve(config, hw)
        return
    if config.model.fast_inference and not hw.cuda:
        with pytest.raises(ResolveError, match="fast_inference"):
            resolve(config, hw)
        return
    if config.model.dtype == "bfloat16" and hw.cuda and not hw.bf16_native:
        with pytest.raises(ResolveError, match="needs a GPU with native bf16"):
            resolve(config, hw)
        return
    r = resolve(config, hw)
    # one precision, matching the dtype; bf16 only where the card computes it natively
    assert (r.bf16, r.fp16) == (CUDA_PRECISION[r.dtype] if hw.cuda else (False, False))
    if r.bf16:
        assert hw.compute_capability >= (8, 0)
    if hw.cuda and config.model.dtype == "auto":
        assert r.dtype == ("bfloat16" if hw.compute_capability >= (8, 0) else "float16")
    if not hw.cuda:
        assert (r.bf16, r.fp16, r.vram_gib) == (False, False, None)
    # TRL's own vLLM engine is never started: vLLM only as unsloth's weight-sharing engine
    assert r.use_vllm == r.fast_inference == (r.generation == "unsloth_vllm")
    if r.fast_inference:
        assert r.backend == "unsloth" and r.vllm_max_model_len == config.model.max_seq_length
    assert r.gradient_checkpointing in ("unsloth", "true", "false")
    if r.backend == "hf":
        assert r.gradient_checkpointing != "unsloth"
    assert r.generation_batch_size == r.per_device_train_batch_size * r.gradient_accumulation_steps
    assert r.generation_batch_size % config.train.num_generations == 0


def test_t4_is_fp16_and_rtx4090_is_bf16_for_the_notebook_preset():
    config = load_config("llama8b_4bit")
    t4 = resolve(config, profile("t4"))
    assert (t4.dtype, t4.bf16, t4.fp16) == ("float16", False, True)
    assert t4.backend == "unsloth" and t4.fast_inference and t4.vram_gib == pytest.approx(14.7)
    assert any("sm75 has no native bf16" in n for n in t4.notes)
    ada = resolve(config, profile("rtx4090"))
    assert (ada.dtype, ada.bf16, ada.fp16) == ("bfloat16", True, False)


def test_bf16_asked_for_on_a_card_without_it_is_refused_with_the_fix():
    with pytest.raises(ResolveError, match="model.dtype=bfloat16 needs a GPU with native bf16.*sm75.*float16"):
        resolve(load_config("llama8b_4bit", ["model.dtype=bfloat16"]), profile("t4"))
    assert resolve(load_config("llama8b_4bit", ["model.dtype=bfloat16"]), profile("a100-40gb")).bf16


def test_hf_backend_never_turns_on_vllm_and_says_so():
    """Defect: --backend hf with a fast_inference preset set TRL's use_vllm=True, which starts a second
    vLLM engine holding its own copy of the weights at the model's full context length."""
    r = resolve(load_config("llama8b_4bit"), profile("rtx3090"), backend="hf")
    assert (r.backend, r.use_vllm, r.fast_inference, r.generation) == ("hf", False, False, "transformers")
    assert r.vllm_max_model_len is None and r.gpu_memory_utilization is None
    assert any("fast_inference" in n and "--backend unsloth" in n for n in r.notes)
    assert r.gradient_checkpointing == "true"  # unsloth's offload does not exist on hf


def test_vllm_is_off_where_unsloth_would_turn_it_off():
    config = load_config("qwen1_5b_4bit")
    no_vllm = dataclasses.replace(profile("rtx3060-12gb"), vllm_installed=False)
    r = resolve(config, no_vllm)
    assert not r.use_vllm and any("vLLM is not installed" in n for n in r.notes)
    pascal = Hardware(name="p100", device="cuda", gpu_name="Tesla P100", compute_capability=(6, 0), total_gib=15.9,
                      gpu_count=1, unsloth_installed=True, vllm_installed=True)
    r = resolve(config, pascal)
    assert not r.use_vllm and r.dtype == "float16" and any("compute capability >= 7.5" in n for n in r.notes)


def test_backend_auto_follows_the_machine():
    config = load_config("tiny")
    assert resolve(config, profile("cpu")).backend == "hf"
    assert resolve(config, profile("t4")).backend == "unsloth"
    without = dataclasses.replace(profile("t4"), unsloth_installed=False)
    assert resolve(config, without).backend == "hf"
    with pytest.raises(ResolveError, match="backend 'unsloth' is not installed"):
        resolve(config, without, backend="unsloth")
    with pytest.raises(ResolveError, match="unknown backend"):
        resolve(config, profile("cpu"), backend="vllm")


def test_card_size_comes_from_memory_vram_gb_else_the_hardware():
    assert resolve(load_config("qwen3b_4bit"), profile("l4")).vram_gib == pytest.approx(22.0)
    assert resolve(load_config("qwen3b_4bit", ["memory.vram_gb=10"]), profile("l4")).vram_gib == 10
    assert resolve(load_config("qwen3b_4bit"), ANY_GPU).vram_gib is None


def test_batch_sizes_are_decided_once():
    r = resolve(load_config("tiny", ["train.num_generations=4", "train.per_device_train_batch_size=8",
                                     "train.gradient_accumulation_steps=2"]), profile("cpu"), num_processes=2)
    assert (r.per_device_train_batch_size, r.generation_batch_size) == (8, 32)
    assert (resolve(load_config("tiny"), profile("cpu")).per_device_train_batch_size
            == load_config("tiny").train.num_generations)


def test_unsloth_loaded_dtype_wins_over_the_plan():
    r = resolve(load_config("llama8b_4bit"), profile("rtx4090"))
    followed = follow_loaded_dtype(r, "float16")
    assert (followed.dtype, followed.bf16, followed.fp16) == ("float16", False, True)
    assert follow_loaded_dtype(r, "bfloat16") is r


@pytest.mark.slow
def test_a_cpu_without_native_bf16_is_told_to_use_float32():
    slow = dataclasses.replace(profile("cpu"), cpu_bf16=False)
    asked = load_config("smollm2_cpu", ["model.dtype=bfloat16"])
    assert any("model.dtype=float32" in n for n in resolve(asked, slow).notes)
    assert not any("float32" in n for n in resolve(asked, profile("cpu")).notes)


def test_auto_dtype_on_a_cpu_is_bf16_only_where_the_cpu_computes_it():
    """The default job (dtype auto) emulating bf16 on an AVX2-only CPU took ~200 s a priming step instead
    of ~3: auto picks float32 there, and says so."""
    without = dataclasses.replace(profile("cpu"), cpu_bf16=False)
    r = resolve(load_config("smollm2_cpu"), without)
    assert r.dtype == "float32" and "model.dtype auto -> float32 (this CPU has no native bf16)" in r.notes
    assert resolve(load_config("smollm2_cpu"), profile("cpu")).dtype == "bfloat16"


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(UnknownProfile, match="unknown GPU profile 'gtx1080'.*t4.*rtx4090.*cpu"):
        profile("gtx1080")


@pytest.mark.slow
def test_resolve_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from lowvram_grpo.settings.resolve import resolve; "
            "from lowvram_grpo.settings.hardware import profile; "
            "from lowvram_grpo.settings.config import load_config; "
            "resolve(load_config('llama8b_4bit'), profile('t4')); "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("hw, preset", [("cpu", "smollm2_cpu"), ("t4", "llama8b_4bit"), ("rtx4090", "llama8b_4bit"),
                                        ("rtx3060-12gb", "llama8b_4bit"), ("rtx4060-8gb", "qwen3b_4bit")])
def test_without_a_preset_the_largest_that_fits_the_card_runs(hw, preset):
    from lowvram_grpo.settings.memory_fit import default_preset

    assert default_preset(profile(hw)) == preset


def test_paged_optimizer_is_plain_8bit_on_a_cpu():
    assert resolve(load_config("smollm2_cpu"), profile("cpu")).optim == "adamw_8bit"
    assert resolve(load_config("llama8b_4bit"), profile("t4")).optim == "paged_adamw_8bit"


def test_vllm_flags_are_read_from_the_one_generation_decision():
    """fast_inference and TRL's use_vllm are not decisions of their own: a Resolved whose generation is
    anything but unsloth's shared engine has both off (before, each was a field set beside generation, and
    a Resolved could say generation 'transformers' with use_vllm on)."""
    t4 = resolve(load_config("llama8b_4bit"), profile("t4"))
    assert (t4.generation, t4.fast_inference, t4.use_vllm) == ("unsloth_vllm", True, True)
    changed = dataclasses.replace(t4, generation="transformers")
    assert (changed.fast_inference, changed.use_vllm) == (False, False)
    summary = t4.summary()
    assert (summary["fast_inference"], summary["use_vllm"], summary["generation"]) == (True, True, "unsloth_vllm")


def test_mixed_precision_after_loading_follows_the_same_rule():
    """follow_loaded_dtype re-applies resolve()'s one rule to the dtype unsloth loaded."""
    t4 = resolve(load_config("llama8b_4bit"), profile("t4"))
    for loaded, expected in CUDA_PRECISION.items():
        followed = follow_loaded_dtype(t4, loaded)
        assert (followed.dtype, followed.bf16, followed.fp16) == (loaded, *expected)


def test_a_reward_model_runs_on_the_runs_device():
    assert resolve(load_config("llama8b_4bit"), profile("t4")).reward_model_device == "cuda"
    assert resolve(load_config("tiny"), profile("cpu")).reward_model_device == "cpu"
