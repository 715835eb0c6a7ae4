"""A virtual NVIDIA card for every card profile the package knows (lowvram_grpo.settings.hardware.PROFILES), put in
place on a CPU machine so that the GPU install set's real code (unsloth's GPU loader, unsloth_zoo's load_vllm, vLLM
0.31's engine config and attention selector) runs for that card as far as a CPU allows. tests/card_matrix.py drives
every GPU preset through it; tests/test_card_matrix.py checks it.

    env = process_environment(stub_dir)      # LD_LIBRARY_PATH with the stand-in driver: set before the process starts
    seen = install(CARDS["t4"], toolkit)     # in that process, before unsloth or vLLM is imported

`CARDS`: per profile its compute capability and memory (the profile's), its SM count, bf16 / fp8 support and the
NVIDIA driver (version, the newest CUDA it runs) of a typical host of that card.

Injected, each because a CPU machine lacks it (INJECTED lists them in this order; tests/test_card_matrix.py checks the
list against what `install` does):
1. "stand-in NVIDIA driver": `libcuda.so.1` built from tests/virtual_card/stub_libcuda.c (every entry returns
   CUDA_ERROR_NO_DEVICE), and `libtorch_cuda.so` / `libc10_cuda.so` from tests/virtual_card/stub_libtorch_cuda.c (the
   five C entry points vLLM 0.31's extensions take from a CUDA torch; the CPU torch of this set has none), compiled with
   gcc into a temporary folder and put first on LD_LIBRARY_PATH with the CUDA runtime the set's nvidia wheels carry:
   vLLM's real compiled extensions (`vllm._C_stable_libtorch`, `_moe_C_stable_libtorch`, `cumem_allocator`) load and
   register their ops. Nothing runs on a device: every driver call fails.
2. "torch.cuda readings": is_available, device_count, current_device, get_device_capability, get_device_properties
   (name, capability, memory, SM count), get_device_name, mem_get_info, is_bf16_supported (what torch says on the
   card: True from sm80), and `torch._C._cuda_getCurrentRawStream` (bitsandbytes' CUDA backend binds it at import).
   With these set before unsloth is imported, unsloth_zoo finds a CUDA device itself (DEVICE_TYPE "cuda") and unsloth
   imports its GPU path (`unsloth._gpu_init`, `unsloth.models.loader.FastLanguageModel`), not its CPU backend.
3. "vllm current_platform": vLLM's own CudaPlatform (the non-NVML class, which reads torch.cuda, 2.): vLLM resolves its
   platform through NVML, absent here.
4. "vllm HAS_TRITON": True. vLLM turns Triton off when triton has no active CUDA driver; on the card it is on.
5. "CUDA toolkit layout": CUDA_HOME with `bin/nvcc` and `lib64/stubs/libcuda.so` (empty files) and the venv's `bin`
   (ninja) on PATH, as a Colab image has: unsloth_zoo's FlashInfer probe only checks these exist.
6. "vllm model inspection in-process": vLLM's registry imports a model class in a fresh Python process to read its
   interfaces (`registry._run_in_subprocess`); that process has none of 2.-5. and sees this CPU machine, where the
   Qwen3.5 module does not import. The stand-in runs the same function in this process.
7. "unsloth offload switches": UNSLOTH_DISABLE_PINNED_MEMORY=1 and UNSLOTH_DISABLE_DOUBLE_BUFFER=1, unsloth_zoo's own
   switches: its gradient-checkpointing offload, set up while the model loads, allocates pinned host buffers and CUDA
   events, which a CPU build of torch cannot make (its GPU buffers and streams are made on first use only).
8. "weights on the CPU": unsloth's GPU loader asks transformers for the weights on `cuda:0`; the stand-in keeps them on
   the CPU (transformers' `from_pretrained` called with device_map "cpu", bitsandbytes 4-bit left out: its kernels are
   CUDA's), and unsloth's patched rotary embeddings make their one-element caches on the CPU (`get_current_device` in
   unsloth.models.llama / gemma answers "cpu": their __init__ allocates on the current device; nothing here runs a
   forward, which indexes those caches by device). The model class, config and tokenizer / processor unsloth picks
   are unchanged.
9. "vllm.LLM": the engine. The real one allocates on the card in its worker. The stand-in builds vLLM's real engine
   config from unsloth_zoo's load_vllm arguments (`EngineArgs(**args).create_engine_config()`), asks vLLM's attention
   selector for the backend of the model's full-attention layers on this capability and KV-cache dtype, records both
   and stops the load there (EngineBuilt, a BaseException no `except Exception` of unsloth or ours catches).
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
STUB_SOURCES = REPO / "tests" / "virtual_card"

INJECTED = ("stand-in NVIDIA driver", "torch.cuda readings", "vllm current_platform", "vllm HAS_TRITON",
            "CUDA toolkit layout", "vllm model inspection in-process", "unsloth offload switches", "weights on the CPU",
            "vllm.LLM")

# SM counts: NVIDIA's published specifications of each card (the profile's gpu_name).
SM_COUNT = {"t4": 40, "v100-16gb": 80, "rtx3060-12gb": 28, "rtx4060-8gb": 24, "rtx3090": 82, "rtx4090": 128,
            "l4": 58, "a10g": 80, "a100-40gb": 108, "h100-80gb": 132}
# The driver of a typical host of each card (version, newest CUDA it runs): Colab's T4 runtime (550.54.15, as
# tests/test_driver_fit.py records it), a Kaggle-like V100 host on CUDA 12.2, a 570 workstation or cloud image (12.8)
# for the Ampere/Ada cards, and the H100 lent on 2026-11-26 (580.159.04, CUDA 13.0: ../shared/gpu/README.md).
DRIVER = {"t4": ("550.54.15", "12.4"), "v100-16gb": ("535.104.05", "12.2"), "h100-80gb": ("580.159.04", "13.0")}
DEFAULT_DRIVER = ("570.172.08", "12.8")
CUDA_CONTEXT_GIB = 0.3  # what the CUDA context takes before anything is loaded: mem_get_info's free = total - this


class EngineBuilt(BaseException):
    """The stand-in engine got as far as a CPU goes: vLLM's engine config built and its attention backend chosen."""


@dataclass(frozen=True)
class VirtualCard:
    profile: str                      # the hardware.PROFILES key
    gpu_name: str
    capability: tuple[int, int]
    total_gib: float
    sm_count: int
    driver_version: str
    driver_cuda: str

    @property
    def bf16(self) -> bool:
        """bf16 in hardware (Ampere, sm80, and newer)."""
        return self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """fp8 tensor cores (Ada sm89, Hopper sm90 and newer)."""
        return self.capability >= (8, 9)

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def properties(self) -> types.SimpleNamespace:
        """torch.cuda.get_device_properties(0) of the card."""
        major, minor = self.capability
        return types.SimpleNamespace(name=self.gpu_name, major=major, minor=minor, total_memory=self.total_bytes,
                                     multi_processor_count=self.sm_count, gcnArchName="", is_integrated=False,
                                     L2_cache_size=4 * 2 ** 20, uuid="00000000-0000-0000-0000-000000000000")

    @property
    def total_bytes(self) -> int:
        return int(self.total_gib * 2 ** 30)


def _cards() -> dict[str, VirtualCard]:
    from lowvram_grpo.settings.hardware import PROFILES

    out = {}
    for name, hw in PROFILES.items():
        if not hw.cuda:
            continue
        version, cuda = DRIVER.get(name, DEFAULT_DRIVER)
        out[name] = VirtualCard(name, hw.gpu_name, tuple(hw.compute_capability), hw.total_gib, SM_COUNT[name],
                                version, cuda)
    return out


CARDS: dict[str, VirtualCard] = _cards()


def build_stubs(target: Path) -> Path:
    """1. Compile the stand-in driver and CUDA-torch libraries into `target` (gcc); returns `target`."""
    target.mkdir(parents=True, exist_ok=True)
    builds = [("stub_libcuda.c", "libcuda.so.1"), ("stub_libtorch_cuda.c", "libtorch_cuda.so"),
              ("stub_libtorch_cuda.c", "libc10_cuda.so")]
    for source, name in builds:
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(target / name),
                        str(STUB_SOURCES / source)], check=True)
    (target / "libcuda.so").unlink(missing_ok=True)
    (target / "libcuda.so").symlink_to("libcuda.so.1")
    return target


def cuda_runtime_dir() -> Optional[Path]:
    """The CUDA runtime (libcudart, libnvrtc) the GPU set's nvidia wheels install, None where it has none."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(root).glob("cu*/lib")):
            if any(lib.glob("libcudart.so*")):
                return lib
    return None


def process_environment(stub_dir: Path, environ: Optional[dict] = None) -> dict:
    """1. The environment a virtual-card process starts with: the stubs and the set's CUDA runtime first on
    LD_LIBRARY_PATH (the dynamic loader reads it when the process starts, so this cannot be set from inside)."""
    env = dict(os.environ if environ is None else environ)
    runtime = cuda_runtime_dir()
    paths = [str(stub_dir)] + ([str(runtime)] if runtime else []) + [p for p in env.get("LD_LIBRARY_PATH", "").split(
        os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    return env


def _toolkit(toolkit: Path) -> None:
    """5."""
    (toolkit / "bin").mkdir(parents=True, exist_ok=True)
    (toolkit / "lib64" / "stubs").mkdir(parents=True, exist_ok=True)
    (toolkit / "bin" / "nvcc").write_text("")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    (toolkit / "lib64" / "stubs" / "libcuda.so").write_text("")
    os.environ["CUDA_HOME"] = str(toolkit)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _torch_readings(card: VirtualCard) -> None:
    """2."""
    import torch

    free = card.total_bytes - int(CUDA_CONTEXT_GIB * 2 ** 30)
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda *a, **k: card.capability
    cuda.get_device_properties = lambda *a, **k: card.properties()
    cuda.get_device_name = lambda *a, **k: card.gpu_name
    cuda.mem_get_info = lambda *a, **k: (free, card.total_bytes)
    cuda.is_bf16_supported = lambda *a, **k: card.bf16
    torch._C._cuda_getCurrentRawStream = lambda *a, **k: 0


def _weights_on_cpu() -> None:
    """8. transformers' from_pretrained with the weights kept on the CPU, unquantized."""
    from transformers import modeling_utils

    original = modeling_utils.PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        kwargs["device_map"] = "cpu"
        kwargs.pop("quantization_config", None)
        return original(cls, *args, **kwargs)

    modeling_utils.PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    import unsloth.models.gemma
    import unsloth.models.llama

    for module in (unsloth.models.llama, unsloth.models.gemma):
        module.get_current_device = lambda: "cpu"


def install(card: VirtualCard, toolkit: Path, engine) -> list[str]:
    """Put `card` in place in this process (2.-9.; 1. is the process's environment: process_environment), before
    unsloth or vLLM is imported. `engine(**load_vllm_engine_args)` is called where unsloth_zoo starts vLLM (9.).
    Returns the names of what was injected, in INJECTED's order."""
    done = []
    stub = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)[0]
    assert (Path(stub) / "libcuda.so.1").exists(), "start this process with process_environment(stub_dir)"
    done.append("stand-in NVIDIA driver")
    _torch_readings(card)
    done.append("torch.cuda readings")
    assert "unsloth" not in sys.modules and "vllm" not in sys.modules, "install() before unsloth and vLLM are imported"
    import vllm.config.vllm
    import vllm.platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform

    vllm.platforms.current_platform = NonNvmlCudaPlatform()
    done.append("vllm current_platform")
    vllm.config.vllm.HAS_TRITON = True
    done.append("vllm HAS_TRITON")
    _toolkit(toolkit)
    done.append("CUDA toolkit layout")
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()
    done.append("vllm model inspection in-process")
    os.environ["UNSLOTH_DISABLE_PINNED_MEMORY"] = "1"
    os.environ["UNSLOTH_DISABLE_DOUBLE_BUFFER"] = "1"
    done.append("unsloth offload switches")
    import unsloth  # noqa: F401  (its GPU path, with 2.)

    _weights_on_cpu()
    done.append("weights on the CPU")
    vllm.LLM = engine
    done.append("vllm.LLM")
    return done
