"""Issue 65's resolve-side defects, decided before anything loads: Gemma 3 on a card without bf16 (unsloth's vLLM starts
in float16 there, which vLLM 0.31 refuses for gemma3_text) and an fp8 KV cache where no vLLM 0.31 attention backend
serves it (sm80/sm86/sm89 with FlashInfer off). Each run as the user does: resolve, and `--dry-run --gpu CARD`, which
ends 0 with the plan or 2 with one `error:` line. The pinned lines these rest on: tests/test_gpu_defects.py (GPU
set)."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli
from lowvram_grpo.core.errors import ResolveError
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import PROFILES
from lowvram_grpo.settings.resolve import fp8_kv_refusal, resolve

# cards vLLM 0.31 runs on (sm75+) without native bf16: the T4 (the V100 is below vLLM's sm75 anyway)
NO_BF16 = [name for name, card in PROFILES.items() if card.cuda and not card.bf16_native
           and card.compute_capability >= (7, 5)]
BF16 = [name for name, card in PROFILES.items() if card.cuda and card.bf16_native]


def present(card: str, nvcc_major: int = 13):
    """`card` as resolve sees it on the card itself with an nvcc of CUDA `nvcc_major` beside torch's CUDA 13.0 build."""
    return dataclasses.replace(PROFILES[card], name="present", nvcc_cuda=(nvcc_major, 0), torch_cuda="13.0")


# ------------------------------------------------------------------------------ Gemma 3 without bf16 (defect 2)

@pytest.mark.parametrize("card", NO_BF16)
def test_gemma3_on_a_card_without_bf16_samples_without_vllm(card):
    """unsloth_zoo's load_vllm serves float16 below sm80 whatever is asked, and vLLM 0.31 refuses float16 for
    gemma3_text: resolve plans unsloth's generate there, with a note that says why (before: unsloth_vllm, a start
    that fails with "The model type 'gemma3_text' does not support float16")."""
    r = resolve(load_config("gemma3_1b"), PROFILES[card])
    assert r.generation == "transformers" and not r.fast_inference and not r.use_vllm
    assert any("vLLM 0.31 refuses float16 for model type gemma3" in note for note in r.notes)


@pytest.mark.parametrize("card", BF16)
def test_gemma3_keeps_vllm_where_the_card_has_bf16(card):
    assert resolve(load_config("gemma3_1b"), PROFILES[card]).generation == "unsloth_vllm"


def test_only_the_model_types_vllm_refuses_in_float16_lose_it_on_a_t4():
    """Qwen3.5 (also float32 in unsloth's training there) and Llama keep vLLM on a T4: vLLM takes them in float16."""
    assert resolve(load_config("qwen3_5_0_8b"), PROFILES["t4"]).generation == "unsloth_vllm"
    assert resolve(load_config("llama8b_4bit"), PROFILES["t4"]).generation == "unsloth_vllm"


# ------------------------------------------------------------------------------ fp8 KV where a backend serves it (3)

@pytest.mark.parametrize("card, flashinfer, served", [
    ("a100-40gb", False, False), ("rtx3090", False, False), ("rtx4090", False, False), ("l4", False, False),
    ("h100-80gb", False, True),                       # FlashAttention 3 takes fp8 on sm90
    ("a100-40gb", True, True), ("rtx3090", True, True), ("rtx4090", True, True),  # FlashInfer from sm80
    ("t4", True, False), ("t4", False, False),        # unsloth_zoo refuses fp8 below sm80
])
def test_fp8_kv_only_where_an_attention_backend_serves_it(card, flashinfer, served):
    assert (fp8_kv_refusal(PROFILES[card], flashinfer) is None) is served


@pytest.mark.parametrize("card", ["a100-40gb", "rtx3090", "rtx4090"])
def test_an_explicit_fp8_without_flashinfer_is_refused_and_auto_does_not_pick_it(card):
    """A named card (its toolchain unknown: FlashInfer off) and the card itself without a matching nvcc: fp8 refused
    in one line, and auto stays 16-bit even where the plan is short of KV room (before: fp8, and vLLM's start
    crashed: FLASH_ATTN, pinned by unsloth_zoo, serves fp8 only on sm90/sm100)."""
    for hardware in (PROFILES[card], present(card, nvcc_major=12)):
        with pytest.raises(ResolveError, match="has no vLLM 0.31 attention backend on .* with FlashInfer off"):
            resolve(load_config("llama8b_4bit", ["model.kv_cache_dtype=fp8"]), hardware)
        short = resolve(load_config("llama8b_4bit", ["memory.gpu_memory_utilization=0.3", "eval.batch_size=64"]),
                        hardware)
        assert short.kv_cache_dtype == "bfloat16" and "fp8 KV has no attention backend" in short.kv_cache_reason
    with_flashinfer = resolve(load_config("llama8b_4bit", ["model.kv_cache_dtype=fp8"]), present(card))
    assert with_flashinfer.vllm_flashinfer and with_flashinfer.kv_cache_dtype == "fp8"


def test_fp8_kv_on_an_h100_stays_allowed_with_flashinfer_off():
    r = resolve(load_config("llama8b_4bit", ["model.kv_cache_dtype=fp8"]), PROFILES["h100-80gb"])
    assert r.vllm_flashinfer is False and r.kv_cache_dtype == "fp8"


# ------------------------------------------------------------------------------ the dry run, as the user runs it

@pytest.mark.slow  # a process each
@pytest.mark.parametrize("args, rc, text", [
    (["--preset", "gemma3_1b", "--gpu", "t4"], 0, "refuses float16 for model type gemma3"),
    (["--preset", "gemma3_1b", "--gpu", "v100-16gb"], 0, "needs compute capability >= 7.5"),
    (["--preset", "llama8b_4bit", "--gpu", "rtx3090", "--set", "model.kv_cache_dtype=fp8"], 2,
     "error: model.kv_cache_dtype=fp8 has no vLLM 0.31 attention backend on NVIDIA GeForce RTX 3090 (sm86) with "
     "FlashInfer off"),
    (["--preset", "llama8b_4bit", "--gpu", "a100-40gb", "--set", "model.kv_cache_dtype=fp8"], 2,
     "error: model.kv_cache_dtype=fp8 has no vLLM 0.31 attention backend on NVIDIA A100-SXM4-40GB (sm80)"),
    (["--preset", "llama8b_4bit", "--gpu", "h100-80gb", "--set", "model.kv_cache_dtype=fp8"], 0, "KV cache fp8"),
], ids=["gemma3-t4", "gemma3-v100", "fp8-3090", "fp8-a100", "fp8-h100"])
def test_the_dry_run_ends_with_the_plan_or_one_line(args, rc, text):
    proc = run_cli(*args, "--dry-run")
    assert proc.returncode == rc, proc.stderr[-2000:]
    if rc == 2:
        assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(text)
        assert proc.stderr.rstrip().endswith("set model.kv_cache_dtype=auto")
    else:
        assert text in proc.stdout and "Traceback" not in proc.stderr
