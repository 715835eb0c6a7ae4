"""The machine a run is decided for: the card present, or a named profile of one a user does not own.

    hardware = detect()             # the card present (or this CPU); imports torch, nothing else heavy
    hardware = profile("t4")        # a Colab T4, for --dry-run --gpu t4 on any machine

`resolve.resolve(config, hardware)` turns a config and one of these into every device-dependent setting;
nothing else in the package asks torch about the device. A profile describes the card as a user of it
would have it: the GPU install set (requirements.txt: unsloth, vLLM) present, the memory torch reports
as the card's total (`torch.cuda.get_device_properties(0).total_memory`, a little under the box's GB;
a desktop card that also drives a display has ~0.3-1 GiB less) and all of it free (`free_gib` None). The card
present also records the memory free when it was detected (`torch.cuda.mem_get_info`, as unsloth_zoo's
load_vllm and the doctor read it): the memory plan is made on that.

The card present also records its build toolchain, read once: the CUDA release of the nvcc FlashInfer would
JIT-compile with (nvcc_cuda_version) and torch's CUDA build (`torch.version.cuda`); a named profile
knows neither (None), so resolve keeps FlashInfer off for it (resolve.choose_flashinfer).

The process's environment is read here too, once: `UNSLOTH_VLLM_STANDBY` (unsloth_zoo's standby mode: it
raises vLLM's gpu_memory_utilization to its own share and puts vLLM to sleep between rollouts), recorded
as `vllm_standby` by `detect()` and by `planning_hardware()` for a named profile (the shell a dry-run is
typed in is the one the run inherits); the memory plan refuses it (memory_plan_terms.refuse_standby).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from lowvram_grpo.core import internals
from lowvram_grpo.core.allocator import mimalloc_library
from lowvram_grpo.core.errors import UnknownProfile


@dataclass(frozen=True)
class Hardware:
    """What decisions depend on: device, compute capability, memory, and which engines are installed."""
    name: str                                        # a profile name, or 'present' for the machine detected
    device: str                                      # 'cuda' or 'cpu'
    gpu_name: Optional[str] = None                   # e.g. 'Tesla T4'
    compute_capability: Optional[tuple[int, int]] = None
    total_gib: Optional[float] = None                # the card's memory as torch reports it (GiB = 2**30 bytes)
    free_gib: Optional[float] = None                 # free on it when detected (torch.cuda.mem_get_info);
                                                     # None: all of it
    gpu_count: int = 0
    cpu_bf16: bool = False                           # the CPU computes bf16 natively (AVX512-BF16 / AMX)
    unsloth_installed: bool = False
    vllm_installed: bool = False
    vllm_bnb_plugin_installed: bool = False          # vllm-bnb-plugin: vLLM >= 0.28 serves bitsandbytes 4-bit
                                                     # only with it
    mimalloc_library: Optional[str] = None           # libmimalloc.so to preload (allocator.py), when installed
    vllm_standby: Optional[str] = None               # UNSLOTH_VLLM_STANDBY's value when set and not "0"
                                                     # (unsloth_vllm_standby)
    nvcc_cuda: Optional[tuple[int, int]] = None      # the CUDA release of the nvcc FlashInfer JIT-compiles with; None:
                                                     # none found (the card present) or not known (a named profile)
    torch_cuda: Optional[str] = None                 # torch.version.cuda ('13.0'); None: a CPU build,
                                                     # or a named profile

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def bf16_native(self) -> bool:
        """bf16 in hardware: Ampere (sm80) and newer. torch.cuda.is_bf16_supported() also says yes on a T4
        (sm75) because it counts emulation, and unsloth then loads fp16 there: never ask torch this."""
        if self.cuda:
            return gpu_bf16_native(self.compute_capability)
        return self.cpu_bf16

    @property
    def sm(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else "-"

    def describe(self) -> str:
        if not self.cuda:
            return f"{self.name}: CPU ({'native' if self.cpu_bf16 else 'no native'} bf16)"
        size = f"{self.total_gib:.1f} GiB" if self.total_gib is not None else "size not given"
        if self.total_gib is not None and self.free_gib is not None:
            size += f", {self.free_gib:.1f} free"
        return (f"{self.name}: {self.gpu_name} ({self.sm}, {size}"
                f"{', ' + str(self.gpu_count) + ' GPUs' if self.gpu_count > 1 else ''})")


BF16_MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: the first NVIDIA cards that compute bf16 in hardware


def gpu_bf16_native(compute_capability: Optional[tuple[int, int]]) -> bool:
    """A card of this compute capability computes bf16 natively (the one rule: resolve's dtype, the doctor's line)."""
    return compute_capability is not None and tuple(compute_capability) >= BF16_MIN_COMPUTE_CAPABILITY


def _gpu(name: str, gpu_name: str, cc: tuple[int, int], total_gib: float) -> Hardware:
    return Hardware(name=name, device="cuda", gpu_name=gpu_name, compute_capability=cc, total_gib=total_gib,
                    gpu_count=1, unsloth_installed=True, vllm_installed=True, vllm_bnb_plugin_installed=True)


# Cards users of this tool train on. total_gib: what torch reports on that card (nvidia-smi's MiB / 1024,
# less what the driver keeps). --gpu NAME plans for one of these on any machine.
PROFILES: dict[str, Hardware] = {
    "t4": _gpu("t4", "Tesla T4", (7, 5), 14.7),                       # Colab's free GPU; no native bf16
    "v100-16gb": _gpu("v100-16gb", "Tesla V100-SXM2-16GB", (7, 0), 15.8),
    "rtx3060-12gb": _gpu("rtx3060-12gb", "NVIDIA GeForce RTX 3060", (8, 6), 11.8),
    "rtx4060-8gb": _gpu("rtx4060-8gb", "NVIDIA GeForce RTX 4060", (8, 9), 7.6),
    "rtx3090": _gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 23.7),
    "rtx4090": _gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 23.6),
    "l4": _gpu("l4", "NVIDIA L4", (8, 9), 22.0),
    "a10g": _gpu("a10g", "NVIDIA A10G", (8, 6), 22.0),
    "a100-40gb": _gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 39.4),
    "h100-80gb": _gpu("h100-80gb", "NVIDIA H100 80GB HBM3", (9, 0), 79.1),
    "cpu": Hardware(name="cpu", device="cpu", cpu_bf16=True),
}


# What --dry-run plans for on a machine without a GPU when no --gpu is named: a card with native bf16 and
# the GPU install set, of unknown size (the plan then gives the smallest card that fits).
ANY_GPU = Hardware(name="any-gpu", device="cuda", gpu_name="an NVIDIA GPU", compute_capability=(8, 0), gpu_count=1,
                   unsloth_installed=True, vllm_installed=True, vllm_bnb_plugin_installed=True)


def profile(name: str) -> Hardware:
    """A named card (PROFILES); an unknown name raises with the list of known ones."""
    key = name.strip().lower()
    if key not in PROFILES:
        raise UnknownProfile(f"unknown GPU profile {name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[key]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cpu_has_native_bf16() -> bool:
    return internals.mkldnn_bf16_supported()


STANDBY_VARIABLE = "UNSLOTH_VLLM_STANDBY"


def unsloth_vllm_standby(environ=None) -> Optional[str]:
    """UNSLOTH_VLLM_STANDBY's value where unsloth_zoo counts it as on (load_vllm: `os.getenv(..., "0") != "0"`),
    else None. The one reader of the variable: detect() and planning_hardware() record it on the Hardware."""
    value = (os.environ if environ is None else environ).get(STANDBY_VARIABLE, "0")
    return None if value == "0" else value


def nvcc_cuda_version(environ) -> Optional[tuple[int, int]]:
    """The CUDA release of the nvcc FlashInfer would JIT-compile with (`nvcc --version`: "release 13.0"), or None."""
    nvcc = shutil.which("nvcc", path=environ.get("PATH")) or next(
        (str(Path(root, "bin", "nvcc")) for root in (environ.get("CUDA_HOME", ""), environ.get("CUDA_PATH", ""),
                                                     "/usr/local/cuda")
         if root and Path(root, "bin", "nvcc").is_file()), None)
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def vllm_has_in_tree_bitsandbytes(version: Optional[str] = None) -> bool:
    """Whether vLLM `version` (default: the installed one, read from its metadata, nothing imported) still serves
    bitsandbytes 4-bit in tree: vLLM < 0.28 (0.28 moved it to vllm-bnb-plugin; unsloth_zoo uses the in-tree
    loader for vLLM <= 0.27.1). False where vLLM is not installed."""
    if version is None:
        try:
            version = md.version("vllm")
        except md.PackageNotFoundError:
            return False
    found = re.match(r"(\d+)\.(\d+)", version)
    return bool(found) and (int(found.group(1)), int(found.group(2))) < (0, 28)


# A GPU driver's device nodes: NVIDIA's, WSL2's GPU paravirtualization (its CUDA), ROCm's (torch.cuda on HIP).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def no_gpu_without_torch(torch_version: Optional[str] = None, nodes: tuple[str, ...] = GPU_DEVICE_NODES) -> bool:
    """True when `torch.cuda.is_available()` is certainly False, known without importing torch (~2 s): the
    installed torch is a CPU build (its version's local label `+cpu`, read from its metadata), or no GPU driver's
    device node exists (CUDA and ROCm open one of GPU_DEVICE_NODES to find a card). False means "maybe a GPU":
    ask torch (detect)."""
    if torch_version is None:
        try:
            torch_version = md.version("torch")
        except md.PackageNotFoundError:
            return True
    return torch_version.endswith("+cpu") or not any(os.path.exists(node) for node in nodes)


def detect() -> Hardware:
    """The machine this process runs on. Imports torch (fine before unsloth), not transformers or trl."""
    import torch


    unsloth, vllm, mimalloc = _installed("unsloth"), _installed("vllm"), mimalloc_library()
    plugin = _installed("vllm_bnb_plugin") or (vllm and vllm_has_in_tree_bitsandbytes())
    if not torch.cuda.is_available():
        return Hardware(name="present", device="cpu", cpu_bf16=cpu_has_native_bf16(),
                        unsloth_installed=unsloth, vllm_installed=vllm, vllm_bnb_plugin_installed=plugin,
                        mimalloc_library=mimalloc, vllm_standby=unsloth_vllm_standby())
    props = torch.cuda.get_device_properties(0)
    free, _ = torch.cuda.mem_get_info(0)  # what unsloth_zoo's load_vllm reads (its get_mem_info) and the doctor shows
    return Hardware(name="present", device="cuda", gpu_name=props.name,
                    compute_capability=(props.major, props.minor), total_gib=props.total_memory / 2 ** 30,
                    free_gib=free / 2 ** 30,
                    gpu_count=torch.cuda.device_count(), cpu_bf16=False, unsloth_installed=unsloth,
                    vllm_installed=vllm, vllm_bnb_plugin_installed=plugin, mimalloc_library=mimalloc,
                    vllm_standby=unsloth_vllm_standby(), nvcc_cuda=nvcc_cuda_version(os.environ),
                    torch_cuda=torch.version.cuda)


def with_memory(hardware: Hardware, total_gib: float) -> Hardware:
    """The same machine with a card of `total_gib` (memory.vram_gb / --vram), all of it free."""
    return replace(hardware, total_gib=total_gib, free_gib=None)


def planning_hardware(config, gpu: "str | None"):
    """The machine --dry-run and --auto-fit decide for: --gpu PROFILE, else the one present; on a machine
    without a GPU, a GPU preset (or --vram) is planned for a generic card with native bf16."""
    if gpu is not None:
        return replace(profile(gpu), vllm_standby=unsloth_vllm_standby())
    present = detect()
    if not present.cuda and (config.requires_cuda or config.model.fast_inference or config.memory.vram_gb is not None):
        return replace(ANY_GPU, vllm_standby=unsloth_vllm_standby())
    return present
