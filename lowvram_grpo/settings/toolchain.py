"""The build tools a GPU run compiles with on first use, checked by the doctor before anything heavy.

A GPU run compiles code the first time it runs: Triton (unsloth's kernels, TRL's fused LM head, torch's
inductor) builds a small C launcher for each kernel with a C compiler and the Python headers
(triton/runtime/build.py: `$CC`, else gcc, else clang; `Python.h` in sysconfig's include dir); FlashInfer,
installed with vLLM, JIT-compiles its CUDA kernels with nvcc and ninja. A machine without them passes
every import and fails minutes into the run, so the doctor says so first:

- no C compiler, or no Python headers: a blocker for a run on a GPU (`apt-get install build-essential
  python3-dev`, or the conda / pyenv Python's own headers);
- FlashInfer where vLLM generates, per compute capability (`flashinfer_lines`): below sm80 vLLM 0.31 has none
  (resolve keeps unsloth from asking for it: Triton attention, the PyTorch sampler); from sm80 on the unsloth
  backend resolve keeps it off too where nvcc is missing or of another CUDA major than torch (choose_flashinfer:
  the line says which); with it allowed, without ninja a note on the unsloth backend (unsloth_zoo's load_vllm then keeps
  vLLM off FlashInfer: FLASH_ATTN attention and the PyTorch sampler), a warning for the hf backend's own engine
  (VLLM_USE_FLASHINFER_SAMPLER=0); with both, nvcc's CUDA release against torch's (a CUDA 12 nvcc beside cu13 torch).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Optional

from lowvram_grpo.settings.findings import block as _block
from lowvram_grpo.settings.findings import note as _note
from lowvram_grpo.settings.findings import ok as _ok
from lowvram_grpo.settings.findings import warn as _warn
from lowvram_grpo.settings.hardware import nvcc_cuda_version
from lowvram_grpo.settings.resolve import FLASHINFER_MIN_COMPUTE_CAPABILITY, NO_FLASHINFER_ENV, choose_flashinfer


def c_compiler(environ=None) -> Optional[str]:
    """The C compiler Triton builds its launchers with: $CC, else gcc, else clang (triton's _find_compiler)."""
    environ = os.environ if environ is None else environ
    if environ.get("CC"):
        return shutil.which(environ["CC"], path=environ.get("PATH")) or None
    for name in ("gcc", "clang"):
        found = shutil.which(name, path=environ.get("PATH"))
        if found:
            return found
    return None


def python_include_dir() -> Path:
    """Where Triton looks for Python.h (its scheme fix for Debian's posix_local)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def _has_nvcc(environ) -> bool:
    if shutil.which("nvcc", path=environ.get("PATH")):
        return True
    return any(Path(root, "bin", "nvcc").is_file()
               for root in (environ.get("CUDA_HOME", ""), environ.get("CUDA_PATH", ""), "/usr/local/cuda") if root)


def toolchain_lines(resolved, environ=None, include_dir: Optional[Path] = None, torch_cuda: Optional[str] = None):
    """The doctor's lines (findings.Line) for the build tools a GPU run of `resolved` needs; none for a CPU run."""
    if not resolved.cuda:
        return []
    environ = os.environ if environ is None else environ
    include_dir = python_include_dir() if include_dir is None else Path(include_dir)
    lines = []
    compiler = c_compiler(environ)
    if compiler is None:
        asked = f"CC={environ['CC']} is not found and " if environ.get("CC") else ""
        lines.append(_block(f"no C compiler ({asked}no gcc or clang on PATH): Triton compiles a launcher for every GPU "
                            "kernel on first use (unsloth's kernels, TRL's fused LM head, torch.compile)",
                            "install one (apt-get install build-essential), or set CC to a C compiler"))
    if not (include_dir / "Python.h").is_file():
        lines.append(_block(f"no Python headers ({include_dir / 'Python.h'} is missing): Triton compiles its kernel "
                            "launchers against them",
                            "install them (apt-get install python3-dev, or the matching python3.X-dev), "
                            "or use a Python that ships them (pyenv, conda, python.org builds)"))
    if compiler is not None and (include_dir / "Python.h").is_file():
        lines.append(_ok(f"build tools for Triton's first-use compiles: {compiler}, {include_dir / 'Python.h'}"))
    if resolved.generation in ("unsloth_vllm", "vllm"):
        lines += flashinfer_lines(resolved, environ, torch_cuda)
    return lines


def flashinfer_lines(resolved, environ, torch_cuda: Optional[str] = None):
    """FlashInfer (vLLM's attention and sampler kernels, JIT-compiled with nvcc and ninja on first use), per compute
    capability: below sm80 vLLM 0.31 has none, and resolve keeps unsloth from asking for its sampler (the load would
    fail); from sm80 it compiles on first use, so nvcc, ninja and nvcc's CUDA against torch's matter."""

    sm, below = resolved.hardware.sm, resolved.hardware.compute_capability < FLASHINFER_MIN_COMPUTE_CAPABILITY
    if below:
        if resolved.generation == "unsloth_vllm":
            return [_ok(f"vLLM without FlashInfer on {sm} ({NO_FLASHINFER_ENV}=1, set for this run): vLLM 0.31 has no "
                        "FlashInfer below sm80, so it attends with Triton (TRITON_ATTN) and samples with PyTorch")]
        if environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0") not in ("", "0"):
            return [_block(f"VLLM_USE_FLASHINFER_SAMPLER={environ['VLLM_USE_FLASHINFER_SAMPLER']} is set and {sm} has "
                           "no FlashInfer in vLLM 0.31: its engine raises at load",
                           "unset VLLM_USE_FLASHINFER_SAMPLER")]
        return []
    if resolved.generation == "unsloth_vllm" and resolved.vllm_flashinfer is False:  # resolve kept it off: why

        return [_ok(f"vLLM without FlashInfer on {sm} ({NO_FLASHINFER_ENV}=1, set for this run): "
                    f"{choose_flashinfer(resolved.hardware)[1]}")]
    if not _find("flashinfer"):
        return []
    missing = [n for n, ok in (("nvcc", _has_nvcc(environ)),
                               ("ninja", shutil.which("ninja", path=environ.get("PATH")))) if not ok]
    what = f"FlashInfer (installed with vLLM) JIT-compiles its kernels with nvcc and ninja on first use on {sm}"
    if missing and resolved.generation == "unsloth_vllm":
        return [_note(f"{what}; {' and '.join(missing)} missing here: unsloth_zoo's load_vllm then keeps vLLM off it "
                      "(FLASH_ATTN attention, the PyTorch sampler); to use it install the CUDA toolkit and ninja "
                      "(pip install ninja)")]
    if missing:
        return [_warn(f"{what}; {' and '.join(missing)} missing here: vLLM 0.31 samples with FlashInfer by default "
                      "(VLLM_USE_FLASHINFER_SAMPLER), and this run's own vLLM engine does not turn it off",
                      "install the CUDA toolkit (nvcc) and ninja (pip install ninja), "
                      "or export VLLM_USE_FLASHINFER_SAMPLER=0")]
    nvcc = nvcc_cuda_version(environ)
    if torch_cuda is None:
        import torch

        torch_cuda = torch.version.cuda
    torch_major = int(str(torch_cuda).split(".")[0]) if torch_cuda and str(torch_cuda)[0].isdigit() else None
    if nvcc is not None and torch_major is not None and nvcc[0] != torch_major:
        off = (f"export {NO_FLASHINFER_ENV}=1 (unsloth then keeps vLLM off FlashInfer)"
               if resolved.generation == "unsloth_vllm"
               else "export VLLM_USE_FLASHINFER_SAMPLER=0")
        return [_warn(f"{what}: nvcc here is CUDA {nvcc[0]}.{nvcc[1]} and torch is built with CUDA {torch_cuda}; "
                      "kernels compiled by one for the other's runtime can fail to build or load minutes into the run",
                      f"put the CUDA {torch_major} toolkit's nvcc first on PATH (or CUDA_HOME), or {off}")]
    return [_ok(f"{what}: nvcc (CUDA {nvcc[0]}.{nvcc[1]}) and ninja found" if nvcc
                else f"{what}: nvcc and ninja found")]


def _find(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
