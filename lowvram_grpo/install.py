"""What this machine still needs installed: the notebook's install cell and `python -m lowvram_grpo.install` ask here.

`install_plan(fit)` lists the modules of the install set that fits the driver (driver_fit.fit_install: nvidia-smi's
CUDA version -> requirements.txt for CUDA 13, requirements-cuda12.txt for CUDA 12, requirements-cuda126.txt where GPU 0
is below sm75 (a P100, a V100), the CPU set without a usable driver or a card no torch 2.13 build has kernels for)
that are missing, and the pip commands that install that set. Every module the set provides is checked,
not a few: a GPU machine with torch and transformers but no unsloth, vLLM or bitsandbytes (a Colab runtime, say)
still needs the GPU set. Imports nothing heavy (it runs before anything is installed).

    python -m lowvram_grpo.install [--dry-run]   # read nvidia-smi, say which set fits, pip-install it here
"""
from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from lowvram_grpo.core.commands import ArgumentParser
from lowvram_grpo.settings.driver_fit import CPU_COMMANDS, InstallFit, fit_install, read_nvidia_smi  # noqa: F401
from lowvram_grpo.settings.installed import CORE_MODULES, CPU_MODULES, GPU_COMMANDS, GPU_MODULES  # noqa: F401

@dataclass(frozen=True)
class InstallPlan:
    fit: InstallFit
    missing: tuple[str, ...]
    commands: tuple[str, ...]  # pip arguments, run from the checkout's root; empty when nothing is missing

    @property
    def gpu(self) -> bool:
        return self.fit.gpu

    def describe(self) -> str:
        where = f"GPU set ({self.fit.pinned.file})" if self.fit.gpu else "CPU set (requirements-cpu*.txt)"
        if not self.missing:
            return f"the {where} is installed: nothing to install"
        return f"missing {', '.join(self.missing)}: installing the {where}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_plan(fit: InstallFit, installed: Optional[Callable[[str], bool]] = None) -> InstallPlan:
    """What to install for the set `fit` (driver_fit.fit_install of this machine's driver). `installed(module)`
    says whether a module is importable (default: this interpreter's find_spec)."""
    installed = installed or _installed
    if fit.gpu:
        modules = GPU_MODULES if fit.vllm else tuple(m for m in GPU_MODULES if not m.startswith("vllm"))
    else:
        modules = CPU_MODULES
    missing = tuple(m for m in modules if not installed(m))
    return InstallPlan(fit, missing, fit.commands if missing else ())


def main(argv=None) -> int:
    """Read this machine's NVIDIA driver (nvidia-smi), say which pinned set fits it, and install that set with this
    interpreter's pip from the checkout's root (--dry-run: print the pip commands only)."""


    parser = ArgumentParser(prog="python -m lowvram_grpo.install", description=main.__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands, install nothing")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    fit = fit_install(read_nvidia_smi())
    print(fit.line)
    root = Path(__file__).resolve().parent.parent
    for command in fit.commands:
        pip = [sys.executable, "-m", "pip", *shlex.split(command)]
        print("pip " + command)
        if not args.dry_run and subprocess.run(pip, cwd=root).returncode:
            print(f"error: pip {command} failed (its output is above): fix what it names and run this again",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
