"""What torch, the NVIDIA driver and the cards report, read once (`read_cuda_facts` -> `CudaFacts`), and the
doctor's lines on them (`cuda_lines`): torch's CUDA build against the driver, whether torch has kernels for
each card, native bf16, free memory, and the CUDA torch's and vLLM's builds need against the driver's, with the
install that fits the driver (driver_fit.py) and a driver update only where one can be done (not on Colab or
Kaggle). On a CPU, tests describe cards with `CudaFacts` (what torch and NVML would report, given as data);
everything after the reading is the same code.
"""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from lowvram_grpo.core import internals
from lowvram_grpo.settings.driver_fit import (
    LEGACY,
    MIN_DRIVER,
    SETS,
    TORCH_ARCHS,
    Driver,
    build_major,
    driver_advice,
    fit_install,
    hosted_runtime,
    parse_nvidia_smi,
    sm,
    torch_has_kernels,
)
from lowvram_grpo.settings.findings import Line
from lowvram_grpo.settings.findings import block as _block
from lowvram_grpo.settings.findings import note as _note
from lowvram_grpo.settings.findings import ok as _ok
from lowvram_grpo.settings.hardware import gpu_bf16_native
from lowvram_grpo.settings.resolve import VLLM_MIN_COMPUTE_CAPABILITY

GIB = 2 ** 30
# vllm 0.31.0's PyPI wheel (requirements.txt) is built for CUDA 13 (driver_fit.SETS); CUDA 13 has no kernels below
# sm75. Its CUDA 12.9 build (requirements-cuda12.txt) is named by its local label, +cu129.
VLLM_CUDA_MAJOR = SETS[13].vllm_cuda
CUDA13_MIN_COMPUTE_CAPABILITY = VLLM_MIN_COMPUTE_CAPABILITY  # resolve.py turns vLLM off below it


@dataclass(frozen=True)
class Card:
    """A CUDA device as torch sees it, with its memory now (torch.cuda.mem_get_info)."""
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_bytes: int
    free_bytes: int

    @property
    def sm(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


@dataclass(frozen=True)
class CudaFacts:
    """The GPU-only readings doctor needs, taken once (`read_cuda_facts`); on CPU, tests describe cards with it."""
    torch_version: str
    torch_cuda: Optional[str]            # torch.version.cuda: the CUDA torch was built with; None = a CPU build
    arch_list: tuple[str, ...] = ()      # torch.cuda.get_arch_list(): the kernels torch carries
    driver: Optional[str] = None         # the NVIDIA driver version (NVML or nvidia-smi)
    driver_cuda: Optional[str] = None    # the newest CUDA that driver runs, e.g. "13.0"
    nvidia_gpus: tuple[str, ...] = ()    # GPUs the driver reports (also when torch cannot use them)
    cards: tuple[Card, ...] = ()         # CUDA devices torch sees
    vllm_version: Optional[str] = None   # the installed vllm distribution ("0.31.0", "0.31.0+cu129"); None: none
    runtime: Optional[str] = None        # "Colab" / "Kaggle" (driver_fit.hosted_runtime): the driver cannot be updated

    @property
    def gpu_present(self) -> bool:
        return bool(self.cards or self.nvidia_gpus)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def read_driver() -> tuple[Optional[str], Optional[str], tuple[str, ...]]:
    """(driver version, the CUDA version it runs, GPU names) from NVML (nvidia-ml-py), else nvidia-smi."""
    try:
        import pynvml  # optional: may be absent

        pynvml.nvmlInit()
        try:
            names = tuple(_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                          for i in range(pynvml.nvmlDeviceGetCount()))
            return (_text(pynvml.nvmlSystemGetDriverVersion()),
                    _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion_v2()), names)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, no GPU: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None, ()
    try:
        query = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30)
        header = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None, ()
    rows = [line.rsplit(",", 1) for line in query.stdout.splitlines() if "," in line] if query.returncode == 0 else []
    read = parse_nvidia_smi(header)
    return (rows[0][1].strip() if rows else (read.version if read else None), read.cuda if read else None,
            tuple(name.strip() for name, _ in rows))


def read_cuda_facts(all_devices: bool = True) -> CudaFacts:
    """This machine: torch's build and the CUDA devices it sees (with free memory), the driver from NVML.
    Reading free memory starts a CUDA context on each device read (only device 0 unless `all_devices`)."""
    import torch

    driver, driver_cuda, names = read_driver()
    cards: list[Card] = []
    arch: tuple[str, ...] = ()
    if torch.cuda.is_available():
        arch = tuple(torch.cuda.get_arch_list())
        for index in range(torch.cuda.device_count() if all_devices else 1):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            cards.append(Card(index, props.name, (props.major, props.minor), total, free))
        if driver_cuda is None:
            driver_cuda = _cuda_version(internals.cuda_driver_version())
    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    return CudaFacts(torch.__version__, torch.version.cuda, arch, driver, driver_cuda, names, tuple(cards),
                     vllm_version,
                     hosted_runtime())


def _version_tuple(text: Optional[str]) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _kernels_advice(card: Card, fit) -> str:
    """The install with kernels for `card` (driver_fit.fit_install of this driver and card), or what to do where no
    pinned torch has any: torch 2.13's CUDA 12.6 build is its one with kernels below sm75 (driver_fit.TORCH_ARCHS)."""
    if fit is not None and fit.gpu and torch_has_kernels(card.compute_capability, TORCH_ARCHS[fit.pinned.torch]):
        return f"{fit.pip_line()} (torch {fit.pinned.torch} has kernels for {card.sm})" + (
            f", then run with --set {' --set '.join(fit.settings)}" if fit.settings else "")
    if fit is not None and fit.name == "cpu-no-kernels":
        return driver_advice(fit, None)
    return (f"torch 2.13's CUDA 12.6 build ({LEGACY.file}) has kernels for sm50 to sm90, its CUDA 12.9 and 13.0 builds "
            "from sm75: install the set for this card (python -m lowvram_grpo.install reads the driver and the card)")


def _builds_line(facts: CudaFacts, fit) -> Line:
    """The driver's CUDA against torch's build and vLLM's, and the pinned set that fits the driver."""
    vllm = (f", vllm {facts.vllm_version} with CUDA {build_major(facts.vllm_version, VLLM_CUDA_MAJOR) or '?'}"
            if facts.vllm_version else ", no vllm installed")
    if fit.gpu:
        fits = f"{fit.pinned.file} is the set for this driver"  # and GPU 0 (fit_install: its torch has the kernels)
    elif fit.name == "cpu-no-kernels":
        fits = f"no torch 2.13 build has kernels for GPU 0 ({sm(fit.driver.compute_capability)}): the CPU set"
    else:
        fits = f"no pinned GPU set runs on it (CUDA 12 builds need a driver >= {MIN_DRIVER[12]}): the CPU set"
    torch = f"is built with CUDA {facts.torch_cuda}" if facts.torch_cuda else "is a CPU build"
    return _note(f"CUDA: the driver runs up to {facts.driver_cuda}; torch {facts.torch_version} {torch}{vllm}: {fits}")


def cuda_lines(facts: CudaFacts, uses_vllm: bool) -> list[Line]:
    """torch's build against the driver, vLLM's build against it, the cards; where a build is newer than the
    driver, the install that fits the driver (and a driver update only where one can be done)."""
    build = facts.torch_cuda
    lines = [_ok(f"torch {facts.torch_version}: " + (f"built with CUDA {build}" if build else "a CPU build"))]
    driver_text = f"NVIDIA driver {facts.driver} (runs CUDA up to {facts.driver_cuda or '?'})"
    if not facts.gpu_present:
        lines.append(_note("no NVIDIA GPU (torch sees no CUDA device, no NVIDIA driver answers): runs go to the CPU"))
        return lines
    card = facts.cards[0].compute_capability if facts.cards else None  # GPU 0's: the install must have its kernels
    fit = fit_install(Driver(facts.driver, facts.driver_cuda, card)) if facts.driver_cuda else None
    advice = driver_advice(fit, facts.runtime) if fit else "update the NVIDIA driver"
    if not facts.cards:
        gpus = ", ".join(facts.nvidia_gpus) or "an NVIDIA GPU"
        if build is None:
            if fit is not None and fit.gpu:
                fix = (f"install torch's CUDA build for this driver: pip install --force-reinstall "
                       f"torch=={fit.pinned.torch} --index-url {fit.pinned.torch_index}, then pip install -r "
                       f"{fit.pinned.file}")
            else:
                fix = advice
            lines.append(_block(f"this machine has {gpus} ({driver_text}) but torch is a CPU build", fix))
        elif facts.driver_cuda and _version_tuple(facts.driver_cuda)[:1] < _version_tuple(build)[:1]:
            lines.append(_block(f"torch is built with CUDA {build}; {driver_text} is too old for it", advice))
        else:
            lines.append(_block(f"torch (CUDA {build}) sees no CUDA device although {driver_text} reports {gpus}",
                                "check nvidia-smi and CUDA_VISIBLE_DEVICES, then run doctor again"))
        if fit is not None:
            lines.append(_builds_line(facts, fit))
        return lines
    major = _version_tuple(build)[:1]
    if (facts.driver and major and major[0] in MIN_DRIVER
            and _version_tuple(facts.driver) < _version_tuple(MIN_DRIVER[major[0]])):
        lines.append(_block(f"torch is built with CUDA {build}, which needs an NVIDIA driver >= "
                            f"{MIN_DRIVER[major[0]]}; this one is {facts.driver}", advice))
    elif facts.driver:
        lines.append(_ok(driver_text))
    else:
        lines.append(_note(f"NVIDIA driver version unknown (no NVML, no nvidia-smi); it runs CUDA "
                           f"{facts.driver_cuda or '?'}"))
    if fit is not None:
        lines.append(_builds_line(facts, fit))
    if uses_vllm:
        vllm_major = build_major(facts.vllm_version, VLLM_CUDA_MAJOR) or VLLM_CUDA_MAJOR
        need = MIN_DRIVER[vllm_major]
        if facts.driver and _version_tuple(facts.driver) < _version_tuple(need):
            lines.append(_block(f"vllm {facts.vllm_version or SETS[13].vllm}'s wheels are built for CUDA {vllm_major}: "
                                f"they need an NVIDIA driver >= {need}, this one is {facts.driver}",
                                f"{advice}; or generate without vLLM: --set model.fast_inference=false (unsloth) / "
                                "model.generation=transformers (hf)"))
    for card in facts.cards:
        bf16 = "native bf16" if gpu_bf16_native(card.compute_capability) else "no native bf16 (fp16 is used)"
        lines.append(_ok(f"GPU {card.index}: {card.name}, {card.sm}, {bf16}; {card.free_bytes / GIB:.1f} of "
                         f"{card.total_bytes / GIB:.1f} GiB free"))
        if not torch_has_kernels(card.compute_capability, facts.arch_list):
            lines.append(_block(f"torch {facts.torch_version} has kernels for {' '.join(facts.arch_list)} only: none "
                                f"runs on {card.sm}", _kernels_advice(card, fit)))
        if (uses_vllm and card.index == 0 and card.compute_capability < CUDA13_MIN_COMPUTE_CAPABILITY
                and (build_major(facts.vllm_version, VLLM_CUDA_MAJOR) or VLLM_CUDA_MAJOR) >= 13):
            lines.append(_block(f"vllm 0.31 (CUDA {VLLM_CUDA_MAJOR}) has no kernels for {card.sm}",
                                "generate without vLLM: --set model.fast_inference=false (unsloth) / "
                                "model.generation=transformers (hf)"))
        used = (card.total_bytes - card.free_bytes) / GIB
        if card.index == 0 and used > 1.0:
            lines.append(_note(f"{used:.1f} GiB of GPU 0 are in use already (a display, another process): the run "
                               "has the free memory only, and the plan below is made against it"))
    if len(facts.cards) > 1:
        lines.append(_note(f"{len(facts.cards)} GPUs: one process trains on GPU 0; several through accelerate launch "
                           "(README: Several GPUs)"))
    return lines
