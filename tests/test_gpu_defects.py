"""Issue 65's five defects against the pinned GPU wheels (CI's GPU-set stage: LOWVRAM_GRPO_GPU_SET=1
LOWVRAM_GRPO_NO_SKIPS=1): what the package's decisions rest on, executed where a CPU runs it, read from the installed
source where it needs a card (tests/card_matrix.py executes those on virtual cards). A bump of unsloth, unsloth_zoo,
vLLM, transformers or torch that changes one of these facts fails here, by name. The decisions themselves: tests/
test_card_defects.py, test_processor_text.py, test_driver_fit.py, test_is_mode_environment.py (CPU suite)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, require_gpu_set

PINS = require_gpu_set()


def _source(module: str) -> str:
    """The installed source of `module`, read from the venv's site-packages without importing it or asking the
    import system: once a test of this worker has imported unsloth without a GPU, unsloth's import blocker answers
    every `vllm` lookup (find_spec gives None, an import raises ModuleNotFoundError)."""
    return Path(sysconfig.get_paths()["purelib"]).joinpath(*module.split(".")[:-1],
                                                           f"{module.split('.')[-1]}.py").read_text()


# ------------------------------------------------------------------------------ 1: Qwen3.5 comes with a processor

def test_qwen3_5_maps_to_a_processor_and_unsloths_vision_loader_returns_auto_processors_class():
    """transformers 5.17 maps qwen3_5 to Qwen3VLProcessor, and unsloth's vision loader returns AutoProcessor's object
    for a vision-language checkpoint: what data.text_tokenizer unwraps."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    assert PROCESSOR_MAPPING_NAMES["qwen3_5"] == "Qwen3VLProcessor"
    vision = _source("unsloth.models.vision")
    assert "auto_processor = AutoProcessor if (needs_processor or is_whisper) else AutoTokenizer" in vision


# ------------------------------------------------------------------------------ 2: Gemma 3 without bf16

def test_vllm_refuses_float16_for_exactly_the_types_resolve_serves_without_it():
    """vLLM 0.31's own check, executed: float16 refused for each model type of resolve.VLLM_NO_FLOAT16_TYPES (and
    their _text configs), taken for the others; no type vLLM refuses is missing from resolve's list. In a fresh
    interpreter: once a test of this worker has imported unsloth without a GPU, its import blocker answers every
    `import vllm` with ModuleNotFoundError."""
    script = textwrap.dedent("""
        import pytest, torch
        from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS, _check_valid_dtype
        from lowvram_grpo.settings.resolve import VLLM_NO_FLOAT16_TYPES

        assert {t.removesuffix("_text") for t in _FLOAT16_NOT_SUPPORTED_MODELS} == set(VLLM_NO_FLOAT16_TYPES)
        for model_type in ("gemma3_text", "gemma3", "gemma2", "glm4"):
            with pytest.raises(ValueError, match=f"'{model_type}' does not support float16"):
                _check_valid_dtype(model_type, torch.float16)
            assert _check_valid_dtype(model_type, torch.bfloat16) and _check_valid_dtype(model_type, torch.float32)
        for model_type in ("qwen3_5_text", "llama", "qwen2", "qwen3"):
            assert _check_valid_dtype(model_type, torch.float16)
        print("CHECKED")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("CHECKED"), proc.stderr[-3000:]


def test_unsloths_vllm_start_serves_float16_below_sm80_and_takes_no_float32():
    """unsloth_zoo's load_vllm: bfloat16 from sm80, float16 below (a bfloat16 request switched), float32 refused: so on
    a T4 no dtype unsloth passes is one vLLM takes for Gemma 3."""
    zoo = _source("unsloth_zoo.vllm_utils")
    assert 'if DEVICE_TYPE == "cuda" and major_version >= 8: _dtype = torch.bfloat16' in zoo
    assert re.search(r"if dtype == torch\.bfloat16 and _dtype == torch\.float16 and not _keep_bf16:"
                     r"\s*\n\s*print\([^\n]*"
                     r"\n\s*dtype = torch\.float16", zoo)
    assert re.search(r"elif dtype == torch\.float16 or dtype == torch\.bfloat16: pass\s*\n\s*else:\s*\n\s*raise "
                     r"NotImplementedError\(f\"Unsloth: We do not support dtype", zoo)
    assert "dtype                  = dtype," in zoo  # handed to vLLM's engine arguments as decided


# ------------------------------------------------------------------------------ 3: fp8 KV and the attention backends

def test_flash_attention_serves_an_fp8_kv_cache_on_sm90_and_sm100_only_and_unsloth_pins_it_without_flashinfer():
    from lowvram_grpo.settings.resolve import FP8_KV_FLASH_ATTN_MAJORS, FP8_KV_MIN_COMPUTE_CAPABILITY

    fa = _source("vllm.v1.attention.backends.fa_utils")
    body = fa[fa.index("def flash_attn_supports_kv_cache_dtype"):fa.index("def flash_attn_supports_quant_query_input")]
    assert "is_sm90 = current_platform.is_device_capability_family(90)" in body
    assert "fa_version == 4 and current_platform.is_device_capability_family(100)" in body
    assert FP8_KV_FLASH_ATTN_MAJORS == (9, 10)
    flash_attn = _source("vllm.v1.attention.backends.flash_attn")
    assert "return flash_attn_supports_kv_cache_dtype(kv_cache_dtype)" in flash_attn
    triton = _source("vllm.v1.attention.backends.triton_attn")
    assert re.search(r'self\.kv_cache_dtype\.startswith\("fp8"\) and not \(\s*'
                     r'current_platform\.has_device_capability\(89\)', triton)
    zoo = _source("unsloth_zoo.vllm_utils")
    assert re.search(r"if _UNSLOTH_FLASHINFER_UNUSABLE:\s*\n\s*if _config_uses_mla\(config\):\s*\n\s*engine_args\["
                     r"\"attention_backend\"\] = \"TRITON_MLA\"\s*\n\s*elif _flash_attn_is_selectable\(\):\s*\n\s*"
                     r"engine_args\[\"attention_backend\"\] = \"FLASH_ATTN\"", zoo)
    assert re.search(r"_no_flashinfer:.*?_UNSLOTH_FLASHINFER_UNUSABLE = True", zoo, re.DOTALL)  # our switch: unusable
    assert "if float8_kv_cache and major_version < 8:" in zoo and FP8_KV_MIN_COMPUTE_CAPABILITY == (8, 0)
    cuda = _source("vllm.platforms.cuda")
    assert re.search(r'raise ValueError\(\s*f"Selected backend \{selected_backend\} is not valid for', cuda)


def test_flashinfer_takes_an_fp8_kv_cache_from_sm80():
    """Read, not run: flashinfer's import asks torch for a CUDA device (tests/card_matrix.py runs it on virtual
    cards)."""
    flashinfer = _source("vllm.v1.attention.backends.flashinfer")
    dtypes = re.search(r"supported_kv_cache_dtypes: ClassVar\[list\[CacheDType\]\] = \[(.*?)\]", flashinfer, re.DOTALL)
    assert '"fp8",' in dtypes.group(1)
    assert "return capability >= DeviceCapability(8, 0) and capability <= DeviceCapability(" in flashinfer


# ------------------------------------------------------------------------------ 4: torch's kernels and Triton's floor

def test_torchs_inductor_compiles_no_triton_kernel_below_sm70():
    """driver_fit.TRITON_MIN_COMPUTE_CAPABILITY: below it requirements-cuda126.txt's line says --backend hf."""
    from lowvram_grpo.settings.driver_fit import TRITON_MIN_COMPUTE_CAPABILITY

    scheduler = _source("torch._inductor.scheduler")
    assert re.search(r'device\.type == "cuda"\s*\n\s*and \(device_props := torch\.cuda\.get_device_properties\(device\)'
                     r'\)\.major < 7\s*\n\s*\):\s*\n\s*raise GPUTooOldForTriton', scheduler)
    assert TRITON_MIN_COMPUTE_CAPABILITY == (7, 0)


# ------------------------------------------------------------------------------ 5: the IS mode variable

def test_unsloths_loss_reads_the_is_mode_variable_over_the_config():
    """unsloth_zoo's GRPO loss lets UNSLOTH_GRPO_VLLM_IS_MODE replace the config's mode: why the run sets it only while
    GRPO trains with the engine, and restores it after (training/grpo.RunTrainer.train)."""
    from lowvram_grpo.settings.resolve import IS_MODE_ENV

    zoo = _source("unsloth_zoo.rl_replacements")
    assert f'os.environ.get("{IS_MODE_ENV}"' in zoo or f"os.environ.get('{IS_MODE_ENV}'" in zoo
