"""The notebook's own card, a Colab T4 (sm75, 14.7 GiB): what resolve decides for it and what --dry-run shows.

unsloth_zoo 2026.10.9 asks vLLM 0.31 for its FlashInfer sampler on every card, and vLLM has no FlashInfer below
sm80: the load fails with a RuntimeError. resolve keeps FlashInfer off there (UNSLOTH_VLLM_NO_FLASHINFER=1, which
the unsloth backend sets before from_pretrained); tests/test_gpu_wheels.py reads the pinned wheels' lines for it."""
import dataclasses

import pytest

from conftest import run_cli
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.settings.resolve import resolve


@pytest.mark.parametrize("card, off", [("t4", True), ("v100-16gb", None), ("rtx3060-12gb", False), ("a100-40gb", False),
                                       ("h100-80gb", False)])
def test_flashinfer_is_kept_off_below_sm80_when_unsloths_vllm_generates(card, off):
    # the toolchain of a card where FlashInfer may run (nvcc of torch's CUDA major: choose_flashinfer)
    hardware = dataclasses.replace(profile(card), nvcc_cuda=(13, 0), torch_cuda="13.0")
    resolved = resolve(load_config("qwen1_5b_4bit", []), hardware, "auto")
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
    a100 = run_cli("--preset", "llama8b_4bit", "--dry-run", "--gpu", "a100-40gb")  # sm80, its toolchain not known here
    assert a100.returncode == 0 and "FlashInfer off" in a100.stdout, a100.stderr[-2000:]
    assert ("vLLM's FlashInfer kept off on sm80 (UNSLOTH_VLLM_NO_FLASHINFER=1): the nvcc and torch CUDA build of a "
            "named card are not known here") in a100.stdout


# (compute capability, nvcc's CUDA release (None: no nvcc), torch's CUDA build) -> FlashInfer allowed, why not
FLASHINFER_TABLE = [
    ((7, 5), (13, 0), "13.0", False, "vLLM 0.31 has no FlashInfer below sm80"),
    ((7, 5), None, "13.0", False, "vLLM 0.31 has no FlashInfer below sm80"),
    ((8, 0), (13, 0), "13.0", True, ""),
    ((8, 6), (13, 1), "13.0", True, ""),
    ((8, 9), (12, 8), "12.8", True, ""),   # the CUDA 12 install: nvcc 12 beside a cu128 torch
    ((8, 6), (12, 4), "13.0", False, "nvcc here is CUDA 12.4 and torch is built with CUDA 13.0"),
    ((8, 9), (12, 8), "13.0", False, "nvcc here is CUDA 12.8 and torch is built with CUDA 13.0"),
    ((9, 0), (13, 0), "12.8", False, "nvcc here is CUDA 13.0 and torch is built with CUDA 12.8"),
    ((8, 6), None, "13.0", False, "no nvcc found"),
    ((9, 0), None, "12.8", False, "no nvcc found"),
    ((8, 6), (13, 0), None, False, "torch's CUDA build is not known"),
]


@pytest.mark.parametrize("cc, nvcc, torch_cuda, allowed, why", FLASHINFER_TABLE)
def test_flashinfer_is_allowed_only_from_sm80_with_an_nvcc_of_torchs_cuda_major(cc, nvcc, torch_cuda, allowed, why):
    """resolve's decision for unsloth's vLLM on the card present (detect() reads nvcc --version and torch.version.cuda):
    off below sm80, and from sm80 wherever FlashInfer's JIT build would run with no nvcc or another CUDA major than
    torch's (unsloth_zoo asks for it whenever nvcc merely exists: tests/test_gpu_wheels.py reads those lines). What
    --dry-run prints (Resolved.describe) says it, and the run's environment carries the switch."""
    card = dataclasses.replace(profile("rtx3090"), name="present", gpu_name="a card", compute_capability=cc,
                               nvcc_cuda=nvcc, torch_cuda=torch_cuda)
    resolved = resolve(load_config("llama8b_4bit", []), card, "auto")
    assert resolved.generation == "unsloth_vllm" and resolved.vllm_flashinfer is allowed
    assert resolved.engine_environment == ({} if allowed else {"UNSLOTH_VLLM_NO_FLASHINFER": "1"})
    shown = resolved.describe()
    notes = [n for n in resolved.notes if "FlashInfer" in n]
    if allowed:
        assert "FlashInfer allowed" in shown and notes == []
        return
    sm = f"sm{cc[0]}{cc[1]}"
    assert ("FlashInfer off" in shown
            and f"note: vLLM's FlashInfer kept off on {sm} (UNSLOTH_VLLM_NO_FLASHINFER=1): " in shown)
    (note,) = notes
    assert why in note and "\n" not in note


def test_without_unsloths_vllm_flashinfer_is_not_decided_whatever_the_toolchain():
    """The hf backend, or fast_inference off: no unsloth engine, no switch (the hf backend's own engine: the doctor)."""
    card = dataclasses.replace(profile("rtx3090"), name="present", nvcc_cuda=(12, 4), torch_cuda="13.0")
    for resolved in (resolve(load_config("llama8b_4bit", []), card, "hf"),
                     resolve(load_config("llama8b_4bit", ["model.fast_inference=false"]), card, "unsloth")):
        assert resolved.vllm_flashinfer is None and resolved.engine_environment == {}


@pytest.mark.parametrize("backend, available_gb, refused", [
    ("hf", 12.7, r"--export merged16 needs ~16\.1 GB of host RAM for .*'s 16-bit weights and this machine has 12\.7 GB "
                 r"available: leave --export out"),
    ("hf", 32.0, None),
    ("unsloth", 12.7, None),  # Colab's RAM: unsloth's merge streams one tensor at a time
    ("unsloth", 1.5, r"--export merged16 needs ~2\.1 GB of host RAM for .*'s largest 16-bit tensor and the merged copy "
                     r"\(unsloth merges one tensor at a time\) and this machine has 1\.5 GB available"),
])
def test_merged16_host_ram_is_checked_for_what_each_backends_merge_holds(backend, available_gb, refused):
    """The hf backend's merge_and_unload holds Llama-3.1-8B's whole 16-bit base (~16.1 GB; Colab has ~12.7 GB);
    unsloth's streamed merge (unsloth_zoo merge_and_overwrite_lora) one tensor and its merged copy
    (the embedding: ~2.1 GB)."""
    from lowvram_grpo.model.backends import check_export_fits_host, host_available_bytes
    from lowvram_grpo.core.errors import BackendError
    from lowvram_grpo.settings.model_shapes import model_facts

    facts = model_facts(load_config("llama8b_4bit").model.name)  # the run's model facts (plan.model.facts)
    if refused:
        with pytest.raises(BackendError, match=refused):
            check_export_fits_host("merged16", facts, backend, available=int(available_gb * 1e9))
    else:
        check_export_fits_host("merged16", facts, backend, available=int(available_gb * 1e9))
    check_export_fits_host("gguf", facts, backend, available=int(1e8))  # unsloth's GGUF writer streams: not this check
    assert host_available_bytes() > 0  # read from /proc/meminfo here


@pytest.mark.parametrize("backend", ["hf", "unsloth"])
def test_a_colab_run_with_merged16_is_refused_on_hf_and_accepted_on_unsloth_before_anything_is_written(
        backend, tmp_path, monkeypatch):
    """GRPORun as `--export merged16` builds it for llama8b_4bit on a T4 with Colab's host RAM (12.7 GB available,
    the reading of /proc/meminfo injected): the hf backend refuses in one line before the model or data loads and
    writes nothing; unsloth's run goes on (its merge streams)."""
    from lowvram_grpo.model import backends
    from lowvram_grpo.core.errors import BackendError
    from lowvram_grpo.run.pipeline import GRPORun

    import huggingface_hub.constants

    monkeypatch.setattr(backends, "host_available_bytes", lambda: int(12.7e9))
    # a Colab session is online: the fast tier under HF_HUB_OFFLINE=1 would otherwise stop the unsloth run at the
    # offline hub check (its model's config.json is not cached here), before the host-RAM decision this test is about
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
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
    from lowvram_grpo.model.unsloth_backend import engine_did_not_start

    resolved = resolve(load_config("qwen1_5b_4bit", []), profile("t4"), "unsloth")
    cause = ("RuntimeError: FlashInfer top-p/top-k sampling unavailable: unsupported compute capability 7.5. "
             "Unset VLLM_USE_FLASHINFER_SAMPLER=1.")
    monkeypatch.delenv("UNSLOTH_VLLM_NO_FLASHINFER", raising=False)
    not_set = str(engine_did_not_start(resolved, cause))
    assert ("unsloth_zoo's load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 itself, so unsetting it does not help: set "
            "UNSLOTH_VLLM_NO_FLASHINFER=1 in the environment") in not_set
    monkeypatch.setenv("UNSLOTH_VLLM_NO_FLASHINFER", "1")
    ignored = str(engine_did_not_start(resolved, cause))
    assert ("UNSLOTH_VLLM_NO_FLASHINFER=1 was set for this load and unsloth_zoo still asked vLLM for FlashInfer"
            in ignored)
    other = str(engine_did_not_start(resolved, "RuntimeError: CUDA out of memory"))
    assert "FlashInfer" not in other and "--set memory.gpu_memory_utilization=LOWER" in other
    for line in (not_set, ignored, other):
        assert "\n" not in line and line.startswith("unsloth could not start vLLM for model.fast_inference on Tesla T4")
        assert "nothing is written yet" in line and line.count("--set model.fast_inference=false") == 1
