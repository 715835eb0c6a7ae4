"""The notebook's own card, a Colab T4 (sm75, 14.7 GiB): what resolve decides for it and what --dry-run shows.

unsloth_zoo 2026.10.9 asks vLLM 0.31 for its FlashInfer sampler on every card, and vLLM has no FlashInfer below
sm80: the load fails with a RuntimeError. resolve keeps FlashInfer off there (UNSLOTH_VLLM_NO_FLASHINFER=1, which
the unsloth backend sets before from_pretrained); tests/test_gpu_wheels.py reads the pinned wheels' lines for it."""
import pytest

from conftest import run_cli
from lowvram_grpo.config import load_config
from lowvram_grpo.hardware import profile
from lowvram_grpo.resolve import resolve


@pytest.mark.parametrize("card, off", [("t4", True), ("v100-16gb", None), ("rtx3060-12gb", False), ("a100-40gb", False),
                                       ("h100-80gb", False)])
def test_flashinfer_is_kept_off_below_sm80_when_unsloths_vllm_generates(card, off):
    resolved = resolve(load_config("qwen1_5b_4bit", []), profile(card), "auto")
    if off is None:  # the V100: vLLM 0.31 does not run there at all (generation through transformers)
        assert resolved.generation == "transformers" and resolved.vllm_flashinfer is None
        assert resolved.engine_environment == {}
        return
    assert resolved.generation == "unsloth_vllm" and resolved.vllm_flashinfer is (not off)
    assert resolved.engine_environment == ({"UNSLOTH_VLLM_NO_FLASHINFER": "1"} if off else {})
    assert resolved.summary()["vllm_flashinfer"] is (not off)


def test_without_unsloths_vllm_nothing_is_set():
    hf = resolve(load_config("qwen1_5b_4bit", []), profile("t4"), "hf")
    no_vllm = resolve(load_config("qwen1_5b_4bit", ["model.fast_inference=false"]), profile("t4"), "unsloth")
    for resolved in (hf, no_vllm):
        assert resolved.vllm_flashinfer is None and resolved.engine_environment == {}


@pytest.mark.slow
def test_dry_run_on_a_t4_says_flashinfer_is_off_and_why():
    proc = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FlashInfer off" in proc.stdout
    assert "vLLM's FlashInfer kept off on sm75 (UNSLOTH_VLLM_NO_FLASHINFER=1)" in proc.stdout
    a100 = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "a100-40gb")
    assert a100.returncode == 0 and "FlashInfer allowed" in a100.stdout and "kept off" not in a100.stdout


def test_a_merged16_export_that_cannot_fit_the_hosts_ram_is_refused_before_anything_loads():
    """Colab's ~12.7 GB of RAM cannot hold Llama-3.1-8B's 16-bit weights (~16 GB): refused in one line."""
    from lowvram_grpo.backends import check_export_fits_host, host_available_bytes
    from lowvram_grpo.errors import BackendError

    name = load_config("llama8b_4bit").model.name
    with pytest.raises(BackendError, match=r"--export merged16 needs ~16\.1 GB of host RAM for .*and this machine has "
                                           r"12\.7 GB available: leave --export out"):
        check_export_fits_host("merged16", name, available=int(12.7e9))
    check_export_fits_host("merged16", name, available=int(32e9))
    check_export_fits_host("gguf", name, available=int(1e9))  # unsloth's GGUF writer streams: not this check
    assert host_available_bytes() > 0  # read from /proc/meminfo here


def test_a_start_that_failed_on_flashinfer_says_what_the_switch_did(monkeypatch):
    """vLLM's advice with its FlashInfer error, "Unset VLLM_USE_FLASHINFER_SAMPLER=1", cannot work: unsloth_zoo's
    load_vllm sets it. The line says what UNSLOTH_VLLM_NO_FLASHINFER was for the load (the pinned load_vllm raising
    this error on sm75, through our load_model: tests/test_gpu_wheels.py)."""
    from lowvram_grpo.backends.unsloth_backend import engine_did_not_start

    resolved = resolve(load_config("qwen1_5b_4bit", []), profile("t4"), "unsloth")
    cause = ("RuntimeError: FlashInfer top-p/top-k sampling unavailable: unsupported compute capability 7.5. "
             "Unset VLLM_USE_FLASHINFER_SAMPLER=1.")
    monkeypatch.delenv("UNSLOTH_VLLM_NO_FLASHINFER", raising=False)
    not_set = str(engine_did_not_start(resolved, cause))
    assert ("unsloth_zoo's load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 itself, so unsetting it does not help: set "
            "UNSLOTH_VLLM_NO_FLASHINFER=1 in the environment") in not_set
    monkeypatch.setenv("UNSLOTH_VLLM_NO_FLASHINFER", "1")
    ignored = str(engine_did_not_start(resolved, cause))
    assert "UNSLOTH_VLLM_NO_FLASHINFER=1 was set for this load and unsloth_zoo still asked vLLM for FlashInfer" in ignored
    other = str(engine_did_not_start(resolved, "RuntimeError: CUDA out of memory"))
    assert "FlashInfer" not in other and "--set memory.gpu_memory_utilization=LOWER" in other
    for line in (not_set, ignored, other):
        assert "\n" not in line and line.startswith("unsloth could not start vLLM for model.fast_inference on Tesla T4")
        assert "nothing is written yet" in line and line.count("--set model.fast_inference=false") == 1
