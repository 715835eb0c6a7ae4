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


@pytest.mark.parametrize("backend, available_gb, refused", [
    ("hf", 12.7, r"--export merged16 needs ~16\.1 GB of host RAM for .*'s 16-bit weights and this machine has 12\.7 GB "
                 r"available: leave --export out"),
    ("hf", 32.0, None),
    ("unsloth", 12.7, None),  # Colab's RAM: unsloth's merge streams one tensor at a time
    ("unsloth", 1.5, r"--export merged16 needs ~2\.1 GB of host RAM for .*'s largest 16-bit tensor and the merged copy "
                     r"\(unsloth merges one tensor at a time\) and this machine has 1\.5 GB available"),
])
def test_merged16_host_ram_is_checked_for_what_each_backends_merge_holds(backend, available_gb, refused):
    """The hf backend's merge_and_unload holds Llama-3.1-8B's whole 16-bit base (~16.1 GB; Colab has ~12.7 GB); unsloth's
    streamed merge (unsloth_zoo merge_and_overwrite_lora) one tensor and its merged copy (the embedding: ~2.1 GB)."""
    from lowvram_grpo.backends import check_export_fits_host, host_available_bytes
    from lowvram_grpo.errors import BackendError

    name = load_config("llama8b_4bit").model.name
    if refused:
        with pytest.raises(BackendError, match=refused):
            check_export_fits_host("merged16", name, backend, available=int(available_gb * 1e9))
    else:
        check_export_fits_host("merged16", name, backend, available=int(available_gb * 1e9))
    check_export_fits_host("gguf", name, backend, available=int(1e8))  # unsloth's GGUF writer streams: not this check
    assert host_available_bytes() > 0  # read from /proc/meminfo here


@pytest.mark.parametrize("backend", ["hf", "unsloth"])
def test_a_colab_run_with_merged16_is_refused_on_hf_and_accepted_on_unsloth_before_anything_is_written(
        backend, tmp_path, monkeypatch):
    """GRPORun as `--export merged16` builds it for llama8b_4bit on a T4 with Colab's host RAM (12.7 GB available,
    the reading of /proc/meminfo injected): the hf backend refuses in one line before the model or data loads and
    writes nothing; unsloth's run goes on (its merge streams)."""
    from lowvram_grpo import backends
    from lowvram_grpo.errors import BackendError
    from lowvram_grpo.pipeline import GRPORun

    monkeypatch.setattr(backends, "host_available_bytes", lambda: int(12.7e9))
    config = load_config("llama8b_4bit", ["data.dataset=null", "data.eval_dataset=null", "data.eval_size=8"])
    out = tmp_path / "run"
    if backend == "hf":
        with pytest.raises(BackendError, match=r"needs ~16\.1 GB of host RAM .* this machine has 12\.7 GB available"):
            GRPORun(config, out, backend=backend, log=lambda *a: None, hardware=profile("t4"), export="merged16")
    else:
        grpo = GRPORun(config, out, backend=backend, log=lambda *a: None, hardware=profile("t4"), export="merged16")
        assert grpo.resolved.backend == "unsloth" and grpo.export_kind == "merged16"
    assert not out.exists()


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
