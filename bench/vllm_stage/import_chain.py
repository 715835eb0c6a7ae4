"""The imports call 4 of the window makes before its first CUDA call, run for real in one group per process.

    python bench/vllm_stage/import_chain.py GROUP     # GROUP: vllm, trl, unsloth, engine

Run with the interpreter and PYTHONPATH call 4 has (the stage's site, then .gpu/site, then the checkout:
bench/gpu_vllm_window.sh `site_path`); CI's import-chain stage (ci_import_chain.sh, tests/test_vllm_stage_chain.py)
runs it in a Python 3.12 venv standing in for the lent image. Prints one line `CHAIN <json>`: the group, each import
done with its seconds, the facts read after them, and, where an import failed, that import, the error, the module
Python could not find (`missing`) and where the import that failed was written (`raised_at`, the last frame).
Exit 0 when every import of the group ran, 1 when one failed, 2 on a bad argument.

- `vllm`: vllm (its version and where it was imported from), vllm.v1.engine.core (which evaluates
  `llguidance.LLMatcher` and `xgr.GrammarMatcher` at import: the H100's stop of 2026-11-27), vllm.entrypoints.llm,
  `from vllm import LLM, SamplingParams`, `from vllm.lora.request import LoRARequest`.
- `trl`: trl.trainer.grpo_trainer, which imports vLLM's LLM where trl finds vllm (trl/generation/vllm_generation.py).
- `unsloth`: the unsloth backend's `prepare()` (lowvram_grpo/model/unsloth_backend.py: `import unsloth` first, then
  `PatchFastRL("GRPO", FastLanguageModel)`), then unsloth_zoo.vllm_utils and vllm.entrypoints.llm again after them
  (unsloth blocks a vLLM that fails to import, and TRL then patches without it); the trainer TRL's module then holds.
  unsloth's import force-loads vLLM's compiled extensions, so this group too needs the stand-in libcuda.so.1 below.
- `engine`: on vLLM's CUDA platform, vLLM's compiled extensions and its engine-start modules (the worker, both model
  runners, the Llama model, the bitsandbytes loader and quantization, the LoRA worker manager, the FlashAttention
  backend, the sampler, the CUDA-memory allocator). Needs a stand-in libcuda.so.1 on LD_LIBRARY_PATH (a CPU machine
  has no driver; tests/virtual_card/stub_libcuda.c: every entry fails, so the extensions load and nothing runs on a
  device) and injects what a CPU machine cannot read (INJECTED): vLLM's current_platform = its CudaPlatform class,
  torch.cuda's readings of the lent H100 (sm90, 79.18 GiB: bench/results/gpu/2026-11-27-h100/vllm-window/
  call1-versions-1.json).
"""
from __future__ import annotations

import importlib
import json
import re
import sys
import time
import traceback
import types

H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=int(79.18 * 2 ** 30),
                             multi_processor_count=132, uuid="stand-in", L2_cache_size=50 * 2 ** 20)
# frames that only carry an import out (Python's import system, vLLM's LazyLoader): `raised_at` is the frame before
MACHINERY = re.compile(r"(^<frozen |/importlib/|/vllm/utils/import_utils\.py$)")
INJECTED = ("vllm current_platform = CudaPlatform", "torch.cuda readings of the lent H100")
EXTENSIONS = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm.cumem_allocator")
ENGINE_MODULES = (
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.lora_model_runner_mixin",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.bitsandbytes_loader",
    "vllm.model_executor.layers.quantization.bitsandbytes",
    "vllm.lora.worker_manager",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.sample.sampler",
    "vllm.device_allocator.cumem",
)


class Chain:
    """The imports done so far and the first failure."""

    def __init__(self, group: str):
        self.report: dict = {"group": group, "imported": [], "facts": {}, "failed": None}

    def step(self, name: str, action) -> bool:
        """Run `action` (an import) named `name`; record its seconds, or the failure. Returns whether it ran."""
        if self.report["failed"] is not None:
            return False
        start = time.time()
        try:
            action()
        except BaseException as exc:  # noqa: BLE001  (anything an import raises is the finding)
            frames = traceback.extract_tb(exc.__traceback__)
            where = next((f for f in reversed(frames) if not MACHINERY.search(f.filename)), None)
            self.report["failed"] = {
                "import": name, "error": f"{type(exc).__name__}: {exc}",
                "missing": getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None,
                "raised_at": f"{where.filename}:{where.lineno}" if where else None}
            return False
        self.report["imported"].append({"import": name, "seconds": round(time.time() - start, 2)})
        return True

    def module(self, name: str) -> bool:
        return self.step(name, lambda: importlib.import_module(name))


def group_vllm(chain: Chain) -> None:
    for name in ("vllm", "vllm.v1.engine.core", "vllm.entrypoints.llm"):
        chain.module(name)

    def llm():
        from vllm import LLM, SamplingParams  # noqa: F401

    def lora():
        from vllm.lora.request import LoRARequest  # noqa: F401

    chain.step("from vllm import LLM, SamplingParams", llm)
    chain.step("from vllm.lora.request import LoRARequest", lora)
    if "vllm" in sys.modules:
        chain.report["facts"].update(vllm=sys.modules["vllm"].__version__, vllm_file=sys.modules["vllm"].__file__)


def group_trl(chain: Chain) -> None:
    chain.module("trl.trainer.grpo_trainer")
    if chain.report["failed"] is None:
        from trl.import_utils import is_vllm_available

        chain.report["facts"]["trl_sees_vllm"] = bool(is_vllm_available())


def group_unsloth(chain: Chain) -> None:
    from lowvram_grpo.model import unsloth_backend

    chain.step("unsloth_backend.prepare(): import unsloth; PatchFastRL('GRPO', FastLanguageModel)",
               unsloth_backend.prepare)
    chain.module("unsloth_zoo.vllm_utils")
    # unsloth blocks a vLLM that fails its import (unsloth/import_fixes.py disable_broken_vllm) and TRL then patches
    # without it: the run would stop later, at load_vllm. vLLM must still import after unsloth, in the same process.
    chain.module("vllm.entrypoints.llm")
    if chain.report["failed"] is None:
        import trl.trainer.grpo_trainer as grpo
        from trl.import_utils import is_vllm_available

        chain.report["facts"].update(patch_problem=unsloth_backend.patched_trainer_problem(),
                                     grpo_trainer=grpo.GRPOTrainer.__name__, trl_sees_vllm=bool(is_vllm_available()))


def group_engine(chain: Chain) -> None:
    for name in EXTENSIONS:
        chain.module(name)

    def platform():
        import torch

        torch.cuda.get_device_capability = lambda *a, **k: (H100.major, H100.minor)
        torch.cuda.get_device_properties = lambda *a, **k: H100
        torch.cuda.get_device_name = lambda *a, **k: H100.name
        torch.cuda.mem_get_info = lambda *a, **k: (H100.total_memory - 2 ** 30, H100.total_memory)
        import vllm.platforms
        from vllm.platforms.cuda import CudaPlatform

        vllm.platforms.current_platform = CudaPlatform()
        chain.report["facts"]["capability"] = vllm.platforms.current_platform.get_device_capability().as_version_str()

    chain.step("vLLM's CudaPlatform with the H100's torch.cuda readings (injected)", platform)
    for name in ENGINE_MODULES:
        chain.module(name)
    chain.report["facts"]["injected"] = list(INJECTED)


GROUPS = {"vllm": group_vllm, "trl": group_trl, "unsloth": group_unsloth, "engine": group_engine}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in GROUPS:
        print(f"error: name one group: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    chain = Chain(argv[0])
    GROUPS[argv[0]](chain)
    print("CHAIN " + json.dumps(chain.report), flush=True)
    return 0 if chain.report["failed"] is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
