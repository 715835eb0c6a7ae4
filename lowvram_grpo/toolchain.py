"""The build tools a GPU run compiles with on first use, checked by the doctor before anything heavy.

A GPU run compiles code the first time it runs: Triton (unsloth's kernels, TRL's fused LM head, torch's
inductor) builds a small C launcher for each kernel with a C compiler and the Python headers
(triton/runtime/build.py: `$CC`, else gcc, else clang; `Python.h` in sysconfig's include dir); FlashInfer,
installed with vLLM, JIT-compiles its CUDA kernels with nvcc and ninja. A machine without them passes
every import and fails minutes into the run, so the doctor says so first:

- no C compiler, or no Python headers: a blocker for a run on a GPU (`apt-get install build-essential
  python3-dev`, or the conda / pyenv Python's own headers);
- FlashInfer without nvcc or ninja where vLLM generates: a note on the unsloth backend (unsloth_zoo's
  load_vllm then keeps vLLM off FlashInfer: FLASH_ATTN attention and the PyTorch sampler), a warning for
  the hf backend's own engine (vLLM 0.31 samples with FlashInfer by default: VLLM_USE_FLASHINFER_SAMPLER=0).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Optional

from .findings import block as _block, note as _note, ok as _ok, warn as _warn


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
    return any(Path(root, "bin", "nvcc").is_file() for root in (environ.get("CUDA_HOME", ""), environ.get("CUDA_PATH", ""),
                                                                "/usr/local/cuda") if root)


def toolchain_lines(resolved, environ=None, include_dir: Optional[Path] = None):
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
                            "install them (apt-get install python3-dev, or the matching python3.X-dev), or use a Python "
                            "that ships them (pyenv, conda, python.org builds)"))
    if compiler is not None and (include_dir / "Python.h").is_file():
        lines.append(_ok(f"build tools for Triton's first-use compiles: {compiler}, {include_dir / 'Python.h'}"))
    if resolved.generation in ("unsloth_vllm", "vllm") and _find("flashinfer"):
        missing = [n for n, ok in (("nvcc", _has_nvcc(environ)),
                                   ("ninja", shutil.which("ninja", path=environ.get("PATH")))) if not ok]
        what = (f"FlashInfer (installed with vLLM) JIT-compiles its kernels with nvcc and ninja on first use; "
                f"{' and '.join(missing)} missing here")
        if missing and resolved.generation == "unsloth_vllm":
            lines.append(_note(f"{what}: unsloth_zoo's load_vllm then keeps vLLM off it (FLASH_ATTN attention, the "
                               "PyTorch sampler); to use it install the CUDA toolkit and ninja (pip install ninja)"))
        elif missing:
            lines.append(_warn(f"{what}: vLLM 0.31 samples with FlashInfer by default (VLLM_USE_FLASHINFER_SAMPLER), and "
                               "this run's own vLLM engine does not turn it off",
                               "install the CUDA toolkit (nvcc) and ninja (pip install ninja), or export "
                               "VLLM_USE_FLASHINFER_SAMPLER=0"))
    return lines


def _find(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
