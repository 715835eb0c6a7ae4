"""Start unsloth's vLLM for a Colab T4 (sm75) on a CPU: our unsloth backend's load_model, the REAL
`unsloth_zoo.vllm_utils.load_vllm` of the pinned wheel and the REAL vLLM 0.31 code up to the sampler's
FlashInfer decision, with only what a CPU machine lacks injected where it is read.

    python tests/sm75_vllm_start.py kept|bypassed        (from the repository root, GPU install set)

- `kept`: resolve's decision for the T4 (UNSLOTH_VLLM_NO_FLASHINFER=1 in `engine_environment`), as a run has it;
- `bypassed`: the same run with that decision left out (engine_environment empty), as on a card resolve allows
  FlashInfer on, or an environment where it does not reach the load.

Prints one line `RESULT <json>`: what the engine stand-in saw (the sampler variable load_vllm set, the model
runner vLLM's config picks, the sampler's FlashInfer decision) and, when the load failed, our error's line and
where its causes were raised.

What runs for real: lowvram_grpo's resolve and unsloth_backend.load_model (engine_environment into os.environ,
the except that turns unsloth's start failure into EngineStopped); unsloth_zoo's load_vllm from its vLLM check
through its FlashInfer probe and switch (vllm_utils.py ~4660-4760), its engine arguments and its failure handling
(~5366-5417: the error re-raised as `RuntimeError(str(error))`); vLLM's EngineArgs.create_engine_config on those
arguments, its model-runner choice, and `flashinfer_sampler_supported()` (vllm/v1/sample/ops/topk_topp_sampler.py),
which imports FlashInferBackend and raises the RuntimeError itself.

Injected, each because a CPU machine lacks it (INJECTED below lists them; the test checks the list):
1. `vllm._C_stable_libtorch`, an empty module: vLLM's compiled CUDA kernels link libcuda.so.1, the NVIDIA driver.
   Without the driver the load fails; unsloth's import then takes vLLM for a broken install and blocks
   `import vllm` for the process (unsloth/import_fixes.py disable_broken_vllm), so load_vllm's module-level
   `find_spec("vllm")` never binds `vllm_version` and load_vllm raises its "vLLM is required" ImportError
   (what tests/test_gpu_wheels.py's other start-failure test reaches). No kernel is run here.
2. torch.cuda's readings of a T4 (get_device_capability 7.5, get_device_properties: 40 SMs and 14.7 GiB,
   mem_get_info): a CPU build of torch has no CUDA device to read.
3. `unsloth_zoo.vllm_utils.DEVICE_TYPE = "cuda"`: unsloth_zoo decides it at import from the device found ("cpu").
4. vLLM's `current_platform` = vLLM's own CudaPlatform class (the non-NVML one, which reads torch.cuda, 2.):
   vLLM resolves its platform from the device found, the CPU platform here.
5. `vllm.config.vllm.HAS_TRITON = True`: vLLM turns Triton off when triton has no active CUDA driver (no GPU); on
   the T4 it is on, and with it vLLM's config picks Model Runner V2, whose Sampler asks
   `flashinfer_sampler_supported()` whatever the logprobs mode (V1 skips it for unsloth's "processed_logprobs").
6. A CUDA toolkit's layout: CUDA_HOME with `bin/nvcc` and `lib64/stubs/libcuda.so` (empty files; Colab has
   /usr/local/cuda), and the venv's `bin` (vLLM's `ninja` requirement) on PATH: load_vllm's FlashInfer probe
   only checks these exist (`_has_nvcc`, `_has_ninja`, `_can_link_libcuda`); without them it turns the
   sampler off itself and nothing about FlashInfer is shown.
7. `vllm.LLM`, the engine: the real one allocates on the card in its worker before its model runner builds the
   sampler. The stand-in builds vLLM's real config from load_vllm's arguments and makes the call the V2
   runner's Sampler.__init__ makes (vllm/v1/worker/gpu/sample/sampler.py: `not return_sampling_mask and
   flashinfer_sampler_supported()`); then it stops the load with EngineBuilt (a BaseException, which neither
   load_vllm's nor load_model's `except Exception` catches), or vLLM's RuntimeError propagates.
8. `unsloth.FastLanguageModel.from_pretrained`, unsloth's GPU loader: on a CPU unsloth's namespace is its CPU
   backend, which never calls load_vllm. The stand-in calls the real load_vllm with the arguments unsloth's GPU
   loader passes (unsloth/models/llama.py `load_vllm_kwargs`; test_gpu_wheels checks those lines), the model's
   config read from its folder; unsloth's own checks before that call are not run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

INJECTED = ("vllm._C_stable_libtorch", "torch.cuda readings", "unsloth_zoo DEVICE_TYPE", "vllm current_platform",
            "vllm HAS_TRITON", "CUDA toolkit layout", "vllm.LLM", "unsloth GPU loader")
T4_TOTAL = int(14.7 * 2 ** 30)  # hardware.profile("t4"): what torch reports on the card
T4_FREE = T4_TOTAL - int(0.3 * 2 ** 30)  # less the CUDA context


class EngineBuilt(BaseException):
    """The stand-in engine got as far as a CPU goes: past the sampler's FlashInfer decision."""


def inject(toolkit: Path) -> dict:
    """1.-8. (module docstring). Returns what the engine stand-in records."""
    # 6. before anything reads them: a toolkit layout, and the venv's own ninja (a vLLM requirement) on PATH
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "lib64" / "stubs").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    (toolkit / "lib64" / "stubs" / "libcuda.so").write_text("")
    os.environ["CUDA_HOME"] = str(toolkit)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")  # 1.
    import unsloth  # noqa: F401  (its CPU backend here; vLLM stays importable thanks to 1.)
    import torch

    t4 = types.SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=T4_TOTAL, multi_processor_count=40)
    torch.cuda.get_device_capability = lambda *a, **k: (7, 5)  # 2.
    torch.cuda.get_device_properties = lambda *a, **k: t4
    torch.cuda.mem_get_info = lambda *a, **k: (T4_FREE, T4_TOTAL)

    import unsloth_zoo.vllm_utils as zoo

    zoo.DEVICE_TYPE = "cuda"  # 3.

    import vllm
    import vllm.config.vllm
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatform

    vllm.platforms.current_platform = CudaPlatform()  # 4.
    vllm.config.vllm.HAS_TRITON = True  # 5.

    seen: dict = {}

    def engine(**engine_args):  # 7.
        from vllm import EngineArgs
        from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported

        config = EngineArgs(**engine_args).create_engine_config()
        seen.update(sampler_env=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"), v2=config.use_v2_model_runner,
                    logprobs_mode=config.model_config.logprobs_mode,
                    capability=vllm.platforms.current_platform.get_device_capability().as_version_str())
        seen["flashinfer"] = not config.model_config.return_sampling_mask and flashinfer_sampler_supported()
        raise EngineBuilt

    vllm.LLM = engine

    def gpu_loader(model_name, max_seq_length, dtype, load_in_4bit, fast_inference, max_lora_rank,
                   gpu_memory_utilization, float8_kv_cache, **_):  # 8.
        from transformers import AutoConfig

        assert fast_inference
        zoo.load_vllm(model_name=model_name, config=AutoConfig.from_pretrained(model_name),
                      gpu_memory_utilization=gpu_memory_utilization, max_seq_length=max_seq_length, dtype=dtype,
                      float8_kv_cache=float8_kv_cache, enable_lora=True, max_lora_rank=max_lora_rank,
                      disable_log_stats=True, use_bitsandbytes=load_in_4bit, unsloth_vllm_standby=False, fp8_mode=None)
        raise AssertionError("the engine stand-in stops every load")

    unsloth.FastLanguageModel.from_pretrained = staticmethod(gpu_loader)
    return seen


def _raised_at(exc: BaseException) -> dict:
    import traceback

    last = traceback.extract_tb(exc.__traceback__)[-1]
    return {"type": type(exc).__name__, "message": str(exc), "file": last.filename, "function": last.name}


def main(mode: str) -> dict:
    for name in ("UNSLOTH_VLLM_NO_FLASHINFER", "VLLM_USE_FLASHINFER_SAMPLER"):
        assert name not in os.environ, f"{name} is set around this test: the load would not decide it"
    with tempfile.TemporaryDirectory() as toolkit:
        seen = inject(Path(toolkit) / "cuda")
        from lowvram_grpo.model.unsloth_backend import load_model
        from lowvram_grpo.settings.config import load_config
        from lowvram_grpo.core.errors import EngineStopped
        from lowvram_grpo.settings.hardware import profile
        from lowvram_grpo.settings.resolve import resolve

        resolved = resolve(load_config("qwen1_5b_4bit", ["model.name=builtin:tiny"]), profile("t4"), "unsloth")
        if mode == "bypassed":
            resolved = dataclasses.replace(resolved, vllm_flashinfer=True)
        result = {"mode": mode, "injected": list(INJECTED), "engine_environment": resolved.engine_environment}
        try:
            load_model(resolved, log=lambda line: None)
        except EngineBuilt:
            result["outcome"] = "engine built"
        except EngineStopped as error:
            result["outcome"] = "EngineStopped"
            result["error"] = str(error)
            unsloth_error = error.__context__  # raise ... from None keeps it as the context
            result["load_vllm_raised"] = _raised_at(unsloth_error)
            result["vllm_raised"] = _raised_at(unsloth_error.__context__)
        result["seen"] = seen
        return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
