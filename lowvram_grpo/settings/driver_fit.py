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

`fit_install(driver)` -> `InstallFit`: the set, the pip commands that install it, whether vLLM can run, the
settings a run needs with it (a set without vLLM: `model.fast_inference=false`), and the one line that says so. `parse_nvidia_smi(text)` reads nvidia-smi's
header into a `Driver`; `read_nvidia_smi()` runs it. `hosted_runtime()` names a Colab or Kaggle runtime, where
the driver is the host's and cannot be updated. Only the standard library: the notebook's install cell runs
this before any package is installed.
"""
from __future__ import annotations

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
CPU_COMMANDS = ("install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
                "install -q --no-deps -r requirements-cpu-nodeps.txt")
NO_VLLM_SETTINGS = ("model.fast_inference=false",)


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


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi says about the NVIDIA driver: its version and the newest CUDA it runs (None: not said)."""
    version: Optional[str]
    cuda: Optional[str]

    @property
    def cuda_major(self) -> Optional[int]:
        found = re.match(r"(\d+)\.", self.cuda or "")
        return int(found.group(1)) if found else None


@dataclass(frozen=True)
class InstallFit:
    """The install set that fits a driver."""
    name: str                     # "cuda13", "cuda12", "cpu" (no NVIDIA driver), "cpu-old-driver"
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


def read_nvidia_smi(run: Callable = subprocess.run) -> Optional[Driver]:
    """This machine's driver from `nvidia-smi` (None: no nvidia-smi on PATH, or it names no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = run([smi], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(f"{out.stdout}\n{out.stderr}")


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
    vllm = pinned.vllm is not None
    what = (f"torch {pinned.torch} and vllm {pinned.vllm}" if vllm else f"torch {pinned.torch}, no vLLM build for it")
    settings = () if vllm else NO_VLLM_SETTINGS
    tail = "vLLM generates" if vllm else f"no vLLM: runs need --set {' --set '.join(settings)}"
    return InstallFit(name, driver, pinned, (f"install -q -r {pinned.file}",), vllm, settings,
                      f"NVIDIA driver {driver.version or '?'} runs CUDA up to {driver.cuda}: {pinned.file} ({what}, "
                      f"CUDA {pinned.torch_cuda}; {why}): {tail}")


def fit_install(driver: Optional[Driver]) -> InstallFit:
    """The pinned set for `driver` (None: no NVIDIA driver answers): CUDA 13 drivers get requirements.txt, CUDA 12
    drivers requirements-cuda12.txt (both with vLLM), anything older or no driver the CPU set."""
    major = driver.cuda_major if driver else None
    if driver is None or major is None:
        return InstallFit("cpu", driver, None, CPU_COMMANDS, False, (),
                          "no NVIDIA driver answers (nvidia-smi): the CPU set (requirements-cpu*.txt), runs on the CPU")
    if major >= 13:
        return _gpu_fit("cuda13", driver, SETS[13], "the default set")
    if major == 12 and (driver.version is None or _version(driver.version) >= _version(MIN_DRIVER[12])):
        return _gpu_fit("cuda12", driver, SETS[12], f"CUDA 12.x builds run on CUDA 12 drivers from {MIN_DRIVER[12]}")
    return InstallFit("cpu-old-driver", driver, None, CPU_COMMANDS, False, (),
                      f"NVIDIA driver {driver.version or '?'} runs CUDA up to {driver.cuda}: torch 2.13 has no build for "
                      f"it (CUDA 12 builds need a driver >= {MIN_DRIVER[12]}): the CPU set, runs on the CPU")


def driver_advice(fit: InstallFit, runtime: Optional[str]) -> str:
    """What to do where torch's or vLLM's CUDA build is newer than the driver: the install that fits it, and a
    driver update only where the user can do one (not on Colab or Kaggle, whose driver is the host's)."""
    if fit.gpu:
        install = fit.pip_line() + (f", then run with --set {' --set '.join(fit.settings)}" if fit.settings else "")
    else:
        install = None
    update = f"update the NVIDIA driver to >= {MIN_DRIVER[13]} (CUDA 13) for {CUDA13_FILE}"
    if runtime:
        return (f"{install} (the set built for this driver's CUDA {fit.driver.cuda}; a {runtime} runtime's NVIDIA "
                "driver is the host's and cannot be updated from inside it)" if install else
                f"this {runtime} runtime's NVIDIA driver is too old for torch 2.13 and cannot be updated from inside it: "
                "choose another runtime (a GPU one with a newer driver), or run a CPU preset (smollm2_cpu)")
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
