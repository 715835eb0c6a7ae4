"""Which pinned install set fits this machine's NVIDIA driver: read from nvidia-smi before anything is installed.

The driver decides what can run. Its header names the newest CUDA it runs ("CUDA Version: 12.4"); a CUDA
runtime of that major version runs on it (NVIDIA's minor-version compatibility: CUDA 12.x from driver
525.60.13, CUDA 13.x from 580.65.06), a newer major does not. The pinned GPU wheels and their CUDA:

- requirements.txt: torch 2.13.0 from PyPI (CUDA 13.0: it requires cuda-toolkit==13.0.3 and nvidia-*-cu13) and
  vllm 0.31.0 from PyPI (CUDA 13: nvidia-cutlass-dsl[cu13], humming-kernels[cu13], kernels linked against
  libcudart.so.13). tests/test_gpu_wheels.py reads these from the wheels' metadata against `SETS` below.
- requirements-cuda12.txt: that set with torch 2.13.0+cu129 (download.pytorch.org/whl/cu129) and vLLM 0.31.0's
  CUDA 12.9 build (vllm-0.31.0+cu129, an asset of vLLM's v0.31.0 GitHub release). Where each pin comes from:
  the file's comments.

- requirements-cuda126.txt: torch 2.13.0+cu126 (download.pytorch.org/whl/cu126) with requirements.txt's other pins
  and no vLLM: the one torch 2.13 build that still carries kernels below sm75 (`TORCH_ARCHS`), for a P100 (sm60)
  or a V100 (sm70) on a CUDA 12 or 13 driver.

The driver alone does not decide: a card needs a torch build with kernels for its compute capability. So the set is
the first, in the driver's order (CUDA 13, CUDA 12.9, CUDA 12.6), whose torch carries the card's kernels; where none
does, the CPU set and one line that says so.

`fit_install(driver)` -> `InstallFit`: the set, the pip commands that install it, whether vLLM can run, the
settings a run needs with it (a set without vLLM: `model.fast_inference=false`), and the one line that says so.
`parse_nvidia_smi(text)` reads nvidia-smi's header into a `Driver`; `read_nvidia_smi()` runs it and asks it for
GPU 0's compute capability. `hosted_runtime()` names a Colab or Kaggle runtime, where
the driver is the host's and cannot be updated. Only the standard library: the notebook's install cell runs
this before any package is installed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

# The oldest Linux driver of each CUDA major version (NVIDIA's CUDA release notes: minor-version compatibility).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
CUDA13_FILE = "requirements.txt"
CUDA12_FILE = "requirements-cuda12.txt"
CUDA126_FILE = "requirements-cuda126.txt"
CPU_COMMANDS = ("install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
                "install -q --no-deps -r requirements-cpu-nodeps.txt")
NO_VLLM_SETTINGS = ("model.fast_inference=false",)
# torch 2.13's inductor compiles no Triton kernel below this (torch/_inductor/scheduler.py: GPUTooOldForTriton), and
# unsloth's kernels are Triton ones: below it only the hf backend trains.
TRITON_MIN_COMPUTE_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class PinnedSet:
    """One pinned GPU set: its file, the CUDA major its torch and vLLM wheels are built for (None: no vLLM)."""
    file: str
    torch: str                 # the torch pin, local label included ("2.13.0", "2.13.0+cu129")
    torch_cuda: int
    torch_index: str           # PyTorch's wheel index of that build (pip --index-url)
    vllm: Optional[str]        # the vLLM pin ("0.31.0", "0.31.0+cu129"); None: this set has no vLLM
    vllm_cuda: Optional[int]


# What the pinned wheels are built for (tests/test_gpu_wheels.py checks the CUDA 13 row against the wheels'
# metadata; tests/test_driver_fit.py checks both rows against the requirement files' pins).
SETS = {13: PinnedSet(CUDA13_FILE, "2.13.0", 13, "https://download.pytorch.org/whl/cu130", "0.31.0", 13),
        12: PinnedSet(CUDA12_FILE, "2.13.0+cu129", 12, "https://download.pytorch.org/whl/cu129", "0.31.0+cu129", 12)}
# torch 2.13's CUDA 12.6 build, for the cards its other builds have no kernels for (no vLLM: vllm 0.31 needs sm75+).
LEGACY = PinnedSet(CUDA126_FILE, "2.13.0+cu126", 12, "https://download.pytorch.org/whl/cu126", None, None)
# The kernels (torch.cuda.get_arch_list()) each pinned torch build carries, Linux x86_64. PyTorch's RELEASE.md "PyTorch
# CUDA Support Matrix", the same for 2.12, 2.13 and 2.14 (pytorch/pytorch#182849, #197555): CUDA 12.6.3 Maxwell(5.0),
# Pascal(6.0), Volta(7.0), Turing(7.5), Ampere(8.0, 8.6), Hopper(9.0); CUDA 13.0.2 Turing(7.5) to Blackwell(10.0,
# 12.0+PTX). CUDA 12.8/12.9 builds dropped Maxwell and Pascal in 2.8 (pytorch#157517) and Volta in 2.11 (#172352,
# #175253: Turing(7.5) to Blackwell(10.0, 12.0)); 2.12 took 12.8 out of the matrix, the cu129 build is its last row's.
TORCH_ARCHS = {
    SETS[13].torch: ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"),
    SETS[12].torch: ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
    LEGACY.torch: ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
}


def torch_has_kernels(cc: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """torch can run on a card of compute capability `cc`: a cubin of the same major and a minor <= the card's
    (sm_86 runs sm_80 code), or PTX (compute_XY) of an older or equal architecture that the driver compiles."""
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+?)(\d)a?", arch)
        if not match:
            continue
        major, minor = int(match.group(2)), int(match.group(3))
        if arch.endswith("a") and (major, minor) != tuple(cc):
            continue  # arch-specific code (sm_90a) runs on that exact architecture only
        if match.group(1) == "sm" and major == cc[0] and minor <= cc[1]:
            return True
        if match.group(1) == "compute" and (major, minor) <= tuple(cc):
            return True
    return not arch_list  # an empty list: torch did not say


def sm(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi says about the NVIDIA driver: its version and the newest CUDA it runs (None: not said), and
    GPU 0's compute capability (None: not asked, or a driver too old to answer `--query-gpu=compute_cap`)."""
    version: Optional[str]
    cuda: Optional[str]
    compute_capability: Optional[tuple[int, int]] = None

    @property
    def cuda_major(self) -> Optional[int]:
        found = re.match(r"(\d+)\.", self.cuda or "")
        return int(found.group(1)) if found else None


@dataclass(frozen=True)
class InstallFit:
    """The install set that fits a driver."""
    name: str                     # "cuda13", "cuda12", "cuda126", "cpu" (no NVIDIA driver), "cpu-old-driver",
                                  # "cpu-no-kernels" (no pinned torch carries the card's kernels)
    driver: Optional[Driver]
    pinned: Optional[PinnedSet]   # the GPU set; None for the CPU set
    commands: tuple[str, ...]     # pip arguments, run from the checkout's root
    vllm: bool                    # can this install generate with vLLM on this driver?
    settings: tuple[str, ...]     # what a run needs with this install (`--set`), e.g. no vLLM
    line: str                     # one line: the driver, the set, what runs

    @property
    def gpu(self) -> bool:
        return self.pinned is not None

    def pip_line(self) -> str:
        return " && ".join(f"pip {c.replace(' -q', '')}" for c in self.commands)


def parse_nvidia_smi(text: str) -> Optional[Driver]:
    """The driver in nvidia-smi's output (its header: "Driver Version: 550.54.15   CUDA Version: 12.4"), or None
    when it names none (no driver loaded: "NVIDIA-SMI has failed because it couldn't communicate ...")."""
    version = re.search(r"Driver Version:\s*([0-9][0-9.]*)", text or "")
    cuda = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", text or "")
    if version is None and cuda is None:
        return None
    return Driver(version.group(1) if version else None, cuda.group(1) if cuda else None)


def parse_compute_capability(text: str) -> Optional[tuple[int, int]]:
    """GPU 0's compute capability in `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` ("7.0"), or None."""
    found = re.match(r"\s*(\d+)\.(\d+)\s*$", (text or "").splitlines()[0] if (text or "").strip() else "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def read_nvidia_smi(run: Callable = subprocess.run) -> Optional[Driver]:
    """This machine's driver from `nvidia-smi` (None: no nvidia-smi on PATH, or it names no driver), with GPU 0's
    compute capability where the driver answers the query."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = run([smi], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    driver = parse_nvidia_smi(f"{out.stdout}\n{out.stderr}")
    if driver is None:
        return None
    try:
        query = run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True,
                    timeout=60)
    except (OSError, subprocess.SubprocessError):
        return driver
    cc = parse_compute_capability(query.stdout) if query.returncode == 0 else None
    return Driver(driver.version, driver.cuda, cc)


def hosted_runtime(environ: Optional[Mapping[str, str]] = None,
                   find: Callable[[str], object] = importlib.util.find_spec) -> Optional[str]:
    """'Colab' or 'Kaggle' where this runs in one (the driver is the host's: it cannot be updated there), else None."""
    environ = os.environ if environ is None else environ
    if environ.get("KAGGLE_KERNEL_RUN_TYPE"):
        return "Kaggle"
    if environ.get("COLAB_RELEASE_TAG") or environ.get("COLAB_GPU") is not None:
        return "Colab"
    try:
        if find("google.colab") is not None:
            return "Colab"
    except (ImportError, ValueError):
        pass
    return None


def _version(text: Optional[str]) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _gpu_fit(name: str, driver: Driver, pinned: PinnedSet, why: str) -> InstallFit:
    if driver.compute_capability is not None:
        why = f"{why}; its torch has kernels for {sm(driver.compute_capability)}"
    vllm = pinned.vllm is not None
    what = (f"torch {pinned.torch} and vllm {pinned.vllm}" if vllm else f"torch {pinned.torch}, no vLLM build for it")
    settings = () if vllm else NO_VLLM_SETTINGS
    tail = "vLLM generates" if vllm else f"no vLLM: runs need --set {' --set '.join(settings)}"
    return InstallFit(name, driver, pinned, (f"install -q -r {pinned.file}",), vllm, settings,
                      f"NVIDIA driver {driver.version or '?'} runs CUDA up to {driver.cuda}: {pinned.file} ({what}, "
                      f"CUDA {pinned.torch_cuda}; {why}): {tail}")


def fit_install(driver: Optional[Driver]) -> InstallFit:
    """The pinned set for `driver` (None: no NVIDIA driver answers) and its card: CUDA 13 drivers get requirements.txt,
    CUDA 12 drivers requirements-cuda12.txt (both with vLLM), each where its torch carries the card's kernels (sm75+);
    a card below (a P100, a V100) requirements-cuda126.txt on either, without vLLM; a card no pinned torch carries,
    a driver older than CUDA 12 or none the CPU set. A card not known (compute capability None): by the driver."""
    major = driver.cuda_major if driver else None
    if driver is None or major is None:
        return InstallFit("cpu", driver, None, CPU_COMMANDS, False, (),
                          "no NVIDIA driver answers (nvidia-smi): the CPU set (requirements-cpu*.txt), runs on the CPU")
    runs12 = major == 12 and (driver.version is None or _version(driver.version) >= _version(MIN_DRIVER[12]))
    if major >= 13:
        choices = [("cuda13", SETS[13], "the default set")]
    elif runs12:
        choices = [("cuda12", SETS[12], f"CUDA 12.x builds run on CUDA 12 drivers from {MIN_DRIVER[12]}")]
    else:
        choices = []
    if choices:  # CUDA 12.6 runs on CUDA 12 and 13 drivers alike
        choices.append(("cuda126", LEGACY, "torch 2.13's CUDA 12.6 build, its one build with kernels below sm75"))
    cc = driver.compute_capability
    for name, pinned, why in choices:
        if cc is None or torch_has_kernels(cc, TORCH_ARCHS[pinned.torch]):  # a card not known: the driver's set
            fit = _gpu_fit(name, driver, pinned, why)
            if cc is not None and cc < TRITON_MIN_COMPUTE_CAPABILITY:
                fit = dataclasses.replace(fit, line=f"{fit.line}; and --backend hf: unsloth's Triton kernels need "
                                                    f"sm70 (torch's inductor refuses {sm(cc)})")
            return fit
    if choices:
        return InstallFit("cpu-no-kernels", driver, None, CPU_COMMANDS, False, (),
                          f"NVIDIA driver {driver.version or '?'} runs CUDA up to {driver.cuda}, and its GPU is "
                          f"{sm(cc)}: no torch 2.13 build carries kernels for it (its CUDA 12.6 build starts at sm50, "
                          "the CUDA 12.9 and 13.0 builds at sm75): the CPU set, runs on the CPU")
    return InstallFit("cpu-old-driver", driver, None, CPU_COMMANDS, False, (),
                      f"NVIDIA driver {driver.version or '?'} runs CUDA up to {driver.cuda}: torch 2.13 has no build "
                      f"for it (CUDA 12 builds need a driver >= {MIN_DRIVER[12]}): the CPU set, runs on the CPU")


def driver_advice(fit: InstallFit, runtime: Optional[str]) -> str:
    """What to do where torch's or vLLM's CUDA build is newer than the driver: the install that fits it, and a
    driver update only where the user can do one (not on Colab or Kaggle, whose driver is the host's)."""
    if fit.gpu:
        install = fit.pip_line() + (f", then run with --set {' --set '.join(fit.settings)}" if fit.settings else "")
    else:
        install = None
    update = f"update the NVIDIA driver to >= {MIN_DRIVER[13]} (CUDA 13) for {CUDA13_FILE}"
    if install and fit.name == "cuda126":  # a newer driver does not help: CUDA 13 builds have no kernels below sm75
        return f"{install} (torch 2.13's one build with kernels for {sm(fit.driver.compute_capability)})"
    if fit.name == "cpu-no-kernels":
        return (f"no torch 2.13 build runs on this card ({sm(fit.driver.compute_capability)}): use another GPU (sm50 "
                "or newer; sm75 or newer for vLLM), or run a CPU preset (smollm2_cpu)")
    if runtime:
        return (f"{install} (the set built for this driver's CUDA {fit.driver.cuda}; a {runtime} runtime's NVIDIA "
                "driver is the host's and cannot be updated from inside it)" if install else
                f"this {runtime} runtime's NVIDIA driver is too old for torch 2.13 and cannot be updated from inside "
                "it: choose another runtime (a GPU one with a newer driver), or run a CPU preset (smollm2_cpu)")
    if install and fit.name == "cuda13":
        return f"{install} (built for this driver's CUDA {fit.driver.cuda})"

    if install:
        return f"{install} (built for this driver's CUDA {fit.driver.cuda}), or {update}"
    return f"{update} (or >= {MIN_DRIVER[12]} for {CUDA12_FILE}), or run a CPU preset (smollm2_cpu)"


def build_major(version: Optional[str], default: Optional[int]) -> Optional[int]:
    """The CUDA major a wheel version is built for: its local label (+cu129 -> 12, +cu130 -> 13, +cpu -> None),
    or `default` (the CUDA of that project's PyPI build) when it has none."""
    if not version:
        return None
    local = version.partition("+")[2]
    if not local:
        return default
    found = re.fullmatch(r"cu(\d+?)(\d)", local)
    return int(found.group(1)) if found else None
