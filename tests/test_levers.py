"""resolve's three decisions of issue 54, per (backend, generation, card): the importance-sampling correction
(train.is_correction), unsloth's decode CUDA graphs, and vLLM's KV-cache dtype (model.kv_cache_dtype), with what each
decision reaches (GRPOConfig, the rollouts, from_pretrained, the memory plan) and the docs/gpu.md table made from them.
Pure decisions: no model loads. The pinned unsloth/unsloth_zoo lines they rest on: tests/test_gpu_wheels.py."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import REPO

from lowvram_grpo.settings.config import load_config
from lowvram_grpo.core.errors import ResolveError
from lowvram_grpo.settings.hardware import PROFILES
from lowvram_grpo.settings.memory_terms import estimate
from lowvram_grpo.settings.resolve import (DECODE_GRAPH_MODEL_TYPES, IS_MODE, IS_MODE_VESPO, choose_decode_graphs,
                                           decode_graphs_environment_note, model_type_of, resolve, without_vllm)
from lowvram_grpo.settings.unsloth_sizing import vllm_budget

CARDS = ("t4", "rtx3090", "rtx4090")
CPU_WITH_VLLM = dataclasses.replace(PROFILES["cpu"], vllm_installed=True)


def resolved(preset: str, card: str, *sets: str, backend: str = "auto", hardware=None):
    return resolve(load_config(preset, list(sets)), hardware or PROFILES[card], backend)


# ----------------------------------------------------------------------------- importance-sampling correction

@pytest.mark.parametrize("card", CARDS)
def test_unsloths_vllm_engine_gets_the_correction_on_by_default_with_mode_and_environment(card):
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    r = resolved("llama8b_4bit", card)
    assert r.generation == "unsloth_vllm" and r.is_correction and r.is_mode == IS_MODE == "sequence_mask"
    assert "unsloth's GRPOConfig would leave the correction off" in r.is_reason and r.is_reason.startswith("auto -> on")
    kwargs = grpo_config_kwargs(r, REPO / "unused")
    assert kwargs["vllm_importance_sampling_correction"] is True and kwargs["vllm_importance_sampling_mode"] == IS_MODE
    assert r.trainer_environment == {"UNSLOTH_GRPO_VLLM_IS_MODE": "sequence_mask"}
    assert "IS correction on (sequence_mask): auto -> on" in r.describe()


def test_our_vllm_engine_and_our_decode_loop_on_a_cpu_get_it_and_transformers_generation_does_not():
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    ours = resolved("smollm2_cpu", "cpu", "model.generation=vllm", hardware=CPU_WITH_VLLM)
    assert ours.generation == "vllm" and ours.is_correction and ours.trainer_environment == {}
    assert "our vLLM engine samples" in ours.is_reason
    loop = resolved("smollm2_cpu", "cpu")  # our decode loop (decode.loop=auto on a CPU): trl_compat.ModelSampler
    assert loop.decode_loop == "lowvram" and loop.is_correction and loop.is_mode == IS_MODE
    assert loop.is_reason.startswith("auto -> on: our decode loop samples")
    assert grpo_config_kwargs(loop, REPO / "unused")["vllm_importance_sampling_correction"] is True
    asked = resolved("smollm2_cpu", "cpu", "decode.loop=transformers", "train.is_correction=on")
    assert asked.is_correction and "transformers' generate samples" in asked.is_reason  # its scores captured
    plain = resolved("smollm2_cpu", "cpu", "decode.loop=transformers")
    assert plain.generation == "transformers" and not plain.is_correction and plain.is_mode is None
    assert "auto keeps the correction off" in plain.is_reason
    assert grpo_config_kwargs(plain, REPO / "unused")["vllm_importance_sampling_correction"] is False
    unsloth_no_vllm = resolved("qwen1_5b_4bit", "rtx3090", "model.fast_inference=false")
    assert unsloth_no_vllm.backend == "unsloth" and not unsloth_no_vllm.is_correction


def test_off_is_kept_on_vllm_and_on_is_refused_without_a_second_sampler():
    off = resolved("qwen1_5b_4bit", "rtx4090", "train.is_correction=off")
    assert not off.is_correction and off.trainer_environment == {} and "differ uncorrected" in off.is_reason
    on = resolved("qwen1_5b_4bit", "rtx4090", "train.is_correction=on")
    assert on.is_correction and on.is_reason.startswith("train.is_correction=on")
    with pytest.raises(ResolveError, match="train.is_correction=on corrects a sampler's log-probs against the "
                                           "trainer's, and this run's rollouts come from unsloth's patched generate"):
        resolved("qwen1_5b_4bit", "rtx3090", "model.fast_inference=false", "train.is_correction=on")


def test_the_trainers_log_probs_come_from_the_loss_on_trls_own_trainer_only():
    """train.is_logprobs (trl_compat.RatioFromLoss): auto = the loss's forward where TRL's trainer applies the
    correction (the hf backend: our loop, our vLLM engine), TRL's extra forward on unsloth's trainer; loss refused
    where it cannot apply; forward keeps TRL's; a run that loses its vLLM engine re-decides it."""
    loop = resolved("smollm2_cpu", "cpu")
    assert loop.is_correction and loop.is_from_loss
    assert "(the trainer's log-probs from the loss's own forward, no extra forward)" in loop.describe()
    assert resolved("smollm2_cpu", "cpu", "model.generation=vllm", hardware=CPU_WITH_VLLM).is_from_loss
    forward = resolved("smollm2_cpu", "cpu", "train.is_logprobs=forward")
    assert forward.is_correction and not forward.is_from_loss
    assert "(the trainer's log-probs from an extra no-grad forward)" in forward.describe()
    assert not resolved("smollm2_cpu", "cpu", "decode.loop=transformers").is_from_loss  # no correction
    unsloth = resolved("llama8b_4bit", "rtx3090")
    assert unsloth.is_correction and not unsloth.is_from_loss
    with pytest.raises(ResolveError, match="train.is_logprobs=loss takes the correction's trainer log-probs from "
                                           "TRL's loss, and the unsloth backend trains with unsloth's GRPO trainer"):
        resolved("llama8b_4bit", "rtx3090", "train.is_logprobs=loss")
    hf = resolved("llama8b_4bit", "rtx3090", "model.fast_inference=false", "train.is_correction=on", backend="hf")
    assert hf.is_correction and hf.is_from_loss
    assert not without_vllm(resolved("llama8b_4bit", "rtx3090"), "no vllm_engine").is_from_loss


def test_vespo_gets_a_token_mode_as_trl_requires():
    r = resolved("qwen1_5b_4bit", "rtx3090", "train.loss_type=vespo")
    assert r.is_correction and r.is_mode == IS_MODE_VESPO == "token_truncate"


def test_a_run_that_loses_its_vllm_engine_at_load_loses_the_correction_and_may_gain_graphs():
    r = resolved("llama8b_4bit", "rtx3090", "train.is_correction=on")
    lost = without_vllm(r, "no vllm_engine")
    assert lost.generation == "transformers" and not lost.is_correction and lost.trainer_environment == {}
    assert lost.decode_graphs and lost.kv_cache_dtype is None  # llama on CUDA without vLLM: unsloth's graphs


# ----------------------------------------------------------------------------- decode CUDA graphs

@pytest.mark.parametrize("card", CARDS)
def test_decode_graphs_for_llama_and_qwen3_without_vllm_on_cuda_only(card):
    llama = resolved("llama8b_4bit", card, "model.fast_inference=false")
    assert llama.decode_graphs and "model type llama" in llama.decode_graphs_reason
    qwen3 = resolved("qwen1_5b_4bit", card, "model.fast_inference=false", "model.name=Qwen/Qwen3-1.7B")
    assert qwen3.decode_graphs
    qwen2 = resolved("qwen1_5b_4bit", card, "model.fast_inference=false")
    assert not qwen2.decode_graphs and "model type qwen2: unsloth 2026.10.9 captures llama, qwen3 only" in \
        qwen2.decode_graphs_reason
    with_vllm = resolved("llama8b_4bit", card)
    assert not with_vllm.decode_graphs and "vLLM samples the rollouts" in with_vllm.decode_graphs_reason
    hf = resolved("llama8b_4bit", card, "model.fast_inference=false", backend="hf")
    assert not hf.decode_graphs and "the hf backend" in hf.decode_graphs_reason


def test_no_decode_graphs_on_a_cpu_and_model_types_read_from_names_and_folders(tmp_path):
    config = load_config("tiny")
    assert choose_decode_graphs(config, PROFILES["cpu"], "unsloth", "transformers") == \
        (False, "unsloth captures them on NVIDIA CUDA only")
    assert [model_type_of(n) for n in ("unsloth/Meta-Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct",
                                       "Qwen/Qwen3-4B", "builtin:smollm2", "google/gemma-3-1b-it", "org/mystery",
                                       "unsloth/Qwen3.5-0.8B", "Qwen/Qwen3.5-9B")] == \
        ["llama", "qwen2", "qwen3", "llama", "gemma3", None, "qwen3_5", "qwen3_5"]  # Qwen3.5 is not Qwen3
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_type_of(str(tmp_path)) == "qwen3" and "qwen3" in DECODE_GRAPH_MODEL_TYPES


def test_an_environment_override_of_the_graphs_is_named():
    on = resolved("llama8b_4bit", "rtx3090", "model.fast_inference=false")
    assert "decodes eagerly" in decode_graphs_environment_note(on, {"UNSLOTH_DECODE_CUDA_GRAPHS": "0"})
    assert decode_graphs_environment_note(on, {"UNSLOTH_DECODE_CUDA_GRAPHS": "1"}) is None
    off = resolved("qwen1_5b_4bit", "rtx3090", "model.fast_inference=false")
    assert "decided off here (model type qwen2" in decode_graphs_environment_note(off,
                                                                                  {"UNSLOTH_DECODE_CUDA_GRAPHS": "1"})
    assert decode_graphs_environment_note(off, {}) is None
    hf = resolved("llama8b_4bit", "rtx3090", "model.fast_inference=false", backend="hf")  # unsloth does not generate
    assert decode_graphs_environment_note(hf, {"UNSLOTH_DECODE_CUDA_GRAPHS": "1"}) is None


# ----------------------------------------------------------------------------- the KV-cache dtype

def test_fp8_kv_is_refused_below_sm80_and_off_vllm():
    t4 = resolved("llama8b_4bit", "t4")
    assert t4.kv_cache_dtype == "float16" and "fp8 KV needs sm80+ and Tesla T4 is sm75" in t4.kv_cache_reason
    with pytest.raises(ResolveError, match="needs compute capability >= 8.0"):
        resolved("llama8b_4bit", "t4", "model.kv_cache_dtype=fp8")
    with pytest.raises(ResolveError, match="this run generates with transformers"):
        resolved("llama8b_4bit", "rtx3090", "model.fast_inference=false", "model.kv_cache_dtype=fp8")
    with pytest.raises(ResolveError, match="the hf backend's vLLM engine keeps its KV cache in the compute dtype"):
        resolved("smollm2_cpu", "cpu", "model.generation=vllm", "model.kv_cache_dtype=fp8", hardware=CPU_WITH_VLLM)
    with pytest.raises(ResolveError,
                       match=r"compute dtype \(bfloat16\) or fp8: set model.kv_cache_dtype=auto, fp8 or bfloat16"):
        resolved("llama8b_4bit", "rtx3090", "model.kv_cache_dtype=float16")


def with_flashinfer(card: str):
    """`card` as resolve sees it on the machine itself with an nvcc of torch's CUDA major: FlashInfer on
    (resolve.choose_flashinfer), so vLLM serves an fp8 KV cache with it from sm80."""
    return dataclasses.replace(PROFILES[card], name="present", nvcc_cuda=(13, 0), torch_cuda="13.0")


@pytest.mark.parametrize("card", ("rtx3090", "rtx4090"))
def test_auto_keeps_16_bit_where_the_plan_has_room_and_picks_fp8_where_it_is_short(card):
    from lowvram_grpo.model.unsloth_backend import from_pretrained_kwargs

    roomy = resolved("llama8b_4bit", card, hardware=with_flashinfer(card))
    assert roomy.vllm_flashinfer and roomy.kv_cache_dtype == "bfloat16"
    assert "holds the rollout and evaluation batches" in roomy.kv_cache_reason
    assert from_pretrained_kwargs(roomy, "m")["float8_kv_cache"] is False
    short = resolved("llama8b_4bit", card, "memory.gpu_memory_utilization=0.3", "eval.batch_size=64",
                     hardware=with_flashinfer(card))
    assert short.kv_cache_dtype == "fp8" and short.kv_cache_reason.startswith("auto -> fp8 (sm")
    assert from_pretrained_kwargs(short, "m")["float8_kv_cache"] is True
    assert "KV cache fp8: auto -> fp8" in short.describe()


def test_the_plans_kv_term_halves_with_fp8_and_unsloths_token_count_uses_its_1_25_bytes():
    sixteen = resolved("llama8b_4bit", "rtx4090", "model.kv_cache_dtype=bfloat16", hardware=with_flashinfer("rtx4090"))
    fp8 = resolved("llama8b_4bit", "rtx4090", "model.kv_cache_dtype=fp8", hardware=with_flashinfer("rtx4090"))
    assert (sixteen.kv_bytes, fp8.kv_bytes) == (2, 1)
    a, b = estimate(sixteen, sixteen.vram_gib), estimate(fp8, fp8.vram_gib)
    assert b.kv_needed_bytes * 2 == a.kv_needed_bytes and b.kv_largest_bytes * 2 == a.kv_largest_bytes
    assert a.kv_cache_bytes == b.kv_cache_bytes  # the same share of the card: fp8 holds twice the tokens in it
    assert "KV cache" in b.terms["vllm"].detail and "(fp8)" in b.terms["vllm"].detail
    shape = a.shape
    gib = 2 ** 30
    plain = vllm_budget(shape, 0.6, 20 * gib, 23.6 * gib, 2048, 32, True)
    small = vllm_budget(shape, 0.6, 20 * gib, 23.6 * gib, 2048, 32, True, float8_kv_cache=True)
    assert small.kv_cache_bytes == plain.kv_cache_bytes and plain.kv_tokens > 10_000
    assert small.kv_tokens == pytest.approx(plain.kv_tokens * 2 / 1.25, abs=2 * 256)  # rounded to 256s, each side


def test_the_summary_and_dry_run_carry_the_three_decisions():
    r = resolved("llama8b_4bit", "rtx3090")
    summary = r.summary()
    assert (summary["is_correction"] is True and summary["decode_graphs"] is False
            and summary["kv_cache_dtype"] == "bfloat16")
    assert summary["is_reason"] and summary["decode_graphs_reason"] and summary["kv_cache_reason"]


# ----------------------------------------------------------------------------- docs/gpu.md's table

def test_the_docs_table_is_the_one_the_code_decides():
    from bench.levers_table import BEGIN, END, table

    text = (REPO / "docs" / "gpu.md").read_text()
    assert BEGIN in text and END in text, "docs/gpu.md lacks the generated levers table (python -m bench.levers_table)"
    shown = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert shown == table().strip(), ("docs/gpu.md's levers table differs from the code's: "
                                      "python -m bench.levers_table --write")
    rows = [line for line in shown.splitlines() if line.startswith("| `")]
    assert len(rows) == len(re.findall(r"\| `", shown)) and len(rows) >= 4 * len(CARDS)
