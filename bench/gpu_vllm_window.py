"""unsloth + vLLM fast_inference GRPO on a lent CUDA card, in one window of back-to-back calls (issue 55).

The lent card's image has torch 2.11.0+cu130 and no vLLM; the pin, vllm 0.31, needs torch 2.13. vLLM 0.26.0 pins
torch==2.11.0, and unsloth_zoo 2026.10.9 serves it (its wheel table, unsloth/import_fixes.py `_VLLM_WHEEL_ASSETS`
0.22.0-0.26.0; vLLM's in-tree bitsandbytes for vLLM <= 0.27.1, unsloth_zoo/vllm_utils.py `_bnb_path` and
unsloth_zoo/empty_model.py `_VLLM_BNB_LOADER_PATHS`). What the card lacks travels in CALLS: `.gpu/site` (unsloth,
unsloth_zoo, trl, bitsandbytes, datasets, peft: bench/prepare_gpu_site.sh) and the vLLM 0.26 wheels in
carried parts (the stage, bench/vllm_stage: fetch_wheels.sh, slim.py, split.sh, join.sh, install.sh). The machine
keeps what earlier calls left while it stays warm (~30 s after each call), so the calls go back to back.

    python -m bench.gpu_vllm_window calls [--require]   # the call list, checked against this checkout (exit 2 if not)
    bash bench/gpu_vllm_window.sh N "$OUT"              # call N's command on the card (N = 1..4)
    bash bench/gpu_vllm_window.sh all /tmp/w --dry      # on a CPU: the call list, then every call but its CUDA steps
    python -m bench.gpu_vllm_window build DIR [--dry]   # the random-weight Llama-3.2-1B-shaped checkpoint (call 1)
    python -m bench.gpu_vllm_window run --out JSON --model-dir DIR [--budget-s S] [--dry]    # the measured run (call 4)

`run` starts `python -m lowvram_grpo.run` (its `main`, in a child process that observes it) on the unsloth backend
with `model.fast_inference=true`, 4-bit, a few GRPO steps at shortened lengths, the before/after held-out answers
through vLLM (the trained adapter as vLLM's LoRA request: the handle's `save_lora` / `load_lora`), and rewrites one
JSON after every phase and step: vLLM's engine start (unsloth_zoo's `load_vllm`) and its memory share against the
plan, rollout ms per generated token, the LoRA sync per step (unsloth_zoo's `load_lora(load_tensors=True)` and vLLM
loading the adapter), step times, the peak against the plan. `--dry` (a CPU): the same run with the CUDA steps
replaced (model.fast_inference=false: transformers generation; no vLLM), on a scaled-down Llama checkpoint.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
MIB, GIB = 2 ** 20, 2 ** 30

# --------------------------------------------------------------------------- the call list

LIMIT_MIB = 60        # what one call may carry, the checkout's own travelling tree counted (the tool's hard limit: 64)
MAX_CARRY = 8         # paths one call may carry (the device tool)
MAX_COMMAND = 2000    # characters of one call's command (the device tool)
WINDOW_S = 600        # the whole sequence from the first call: the machine's start, every call's timeout
START_S = 60          # a call that finds no warm machine spends "a minute or more" starting one (device README)
SITE, STAGE = ".gpu", ".vs"
PREPARE = ("bash bench/vllm_stage/fetch_wheels.sh && python3 bench/vllm_stage/slim.py && "
           "bash bench/vllm_stage/split.sh")  # split's 56 MiB folders leave the tree 4.9 MiB of LIMIT_MIB


@dataclass(frozen=True)
class Call:
    """One device call of the window: what it carries, its command, its timeout and what it does."""

    number: int
    carry: tuple
    timeout_s: int
    work: str
    # each carried folder's size when prepared here (.gpu 2026-11-27, .vs 2026-11-28); used where absent
    recorded_mib: tuple

    @property
    def command(self) -> str:
        return f'bash bench/gpu_vllm_window.sh {self.number} "$OUT"'


CALLS = (
    Call(1, (".gpu",), 60, "copies .gpu/site to the machine's /tmp; nvidia-smi, versions; builds the random "
         "Llama-3.2-1B-shaped checkpoint there", (46.44,)),
    Call(2, (".vs/p01",), 20, "stashes vLLM 0.26's first part (join.sh --stash)", (55.01,)),
    Call(3, (".vs/p02",), 20, "stashes the second part", (55.01,)),
    Call(4, (".vs/p03",), 440, "the last part: rejoin and verify (join.sh --verify), pip install --no-index into "
         "/tmp; the measured run (python -m lowvram_grpo.run, unsloth + vLLM), its JSON after every phase", (54.73,)),
)
LAST_CALL_RESERVE_S = 20  # of the last call's timeout: stopping the run and writing the JSON


def _folder_bytes(path: Path) -> tuple[int, list[str]]:
    """Bytes of the plain files under `path` (apparent sizes: what is copied) and the links found there (a link
    travels only as a link)."""
    total, links = 0, []
    for base, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(base) / name
            if full.is_symlink():
                links.append(str(full))
            elif name in files:
                total += full.stat().st_size
    return total, links


def tree_bytes(root: Path) -> int:
    """The checkout's travelling tree: tracked and untracked-not-ignored files (what every call sends)."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    total = 0
    for name in filter(None, listed):
        with contextlib.suppress(OSError):
            total += (root / name).lstat().st_size
    return total


def _ignored(root: Path, path: str) -> bool:
    return subprocess.run(["git", "-C", str(root), "check-ignore", "-q", path]).returncode == 0


def _nested(a: str, b: str) -> bool:
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_calls(root: Path = REPO, calls=CALLS, require: bool = False) -> dict:
    """The call list against the checkout at `root`: each call's carried folders plus the travelling tree within
    LIMIT_MIB, no path carried twice (or inside another carried path), each carried path ignored by git (else it
    would travel with every call), no link in it, at most MAX_CARRY paths and MAX_COMMAND characters, every vLLM
    part the stage holds carried once with the install in the last call, and the timeouts plus a machine start
    within WINDOW_S. A folder not present here is counted at its recorded size (`require`: a problem).
    Returns {'tree_mib', 'calls': [...], 'window_s', 'problems': [...]}."""
    root = Path(root)
    tree = tree_bytes(root)
    problems, rows, seen = [], [], []
    for call in calls:
        carried, sources = 0, []
        if len(call.carry) > MAX_CARRY:
            problems.append(f"call {call.number} carries {len(call.carry)} paths (the tool takes {MAX_CARRY})")
        if len(call.command) > MAX_COMMAND:
            problems.append(f"call {call.number}'s command is {len(call.command)} characters "
                            f"(the tool takes {MAX_COMMAND})")
        for path, recorded in zip(call.carry, call.recorded_mib):
            for number, other in seen:
                if _nested(path, other):
                    problems.append(f"{path} (call {call.number}) is carried again: call {number} carries {other}")
            seen.append((call.number, path))
            folder = root / path
            if folder.is_dir():
                size, links = _folder_bytes(folder)
                sources.append("measured")
                if links:
                    problems.append(f"{path} holds links, which travel only as links: {', '.join(links[:3])}")
                if not _ignored(root, path):
                    problems.append(f"{path} is not ignored by git: it would travel with every call (add "
                                    f"/{path.split('/')[0]}/ to .git/info/exclude)")
            else:
                size = int(recorded * MIB)
                sources.append("recorded")
                if require:
                    problems.append(f"{path} is not here: {_prepare_hint(path)}")
            carried += size
        total = carried + tree
        if total > LIMIT_MIB * MIB:
            problems.append(f"call {call.number} carries {carried / MIB:.2f} MiB + the tree {tree / MIB:.2f} MiB = "
                            f"{total / MIB:.2f} MiB, over {LIMIT_MIB} MiB: split the vLLM parts smaller (LIMIT_MIB in "
                            f"split.sh) or make the tree smaller")
        rows.append({"call": call.number, "carry": list(call.carry), "command": call.command,
                     "timeout_s": call.timeout_s,
                     "carried_mib": round(carried / MIB, 2), "with_tree_mib": round(total / MIB, 2),
                     "sizes": sources, "work": call.work})
    problems += _stage_problems(root, calls)
    window = START_S + sum(c.timeout_s for c in calls)
    if window > WINDOW_S:
        problems.append(f"the calls' timeouts and a machine start take {window} s, over the window's {WINDOW_S} s")
    return {"tree_mib": round(tree / MIB, 2), "limit_mib": LIMIT_MIB, "calls": rows, "window_s": window,
            "problems": problems}


def _prepare_hint(path: str) -> str:
    if path.startswith(SITE):
        return "build it with `bash bench/prepare_gpu_site.sh` from the checkout's root"
    return f"make the vLLM parts with `{PREPARE}` from the checkout's root"


def _stage_problems(root: Path, calls) -> list[str]:
    """Every part folder in .vs carried by exactly one call, the last one by the last call (join.sh installs
    there); every payload file of the stage's MANIFEST in a carried folder."""
    stage = root / STAGE
    carried = [p for c in calls for p in c.carry if p.startswith(STAGE + "/")]
    last = [p for p in calls[-1].carry if p.startswith(STAGE + "/")]
    problems = []
    if not carried or not last or sorted(carried)[-1] != last[-1]:
        problems.append(f"the last call must carry the last vLLM part (join.sh installs there); it carries "
                        f"{', '.join(calls[-1].carry)}")
    if not stage.is_dir():
        return problems
    present = sorted(p.name for p in stage.iterdir() if p.is_dir() and p.name.startswith("p"))
    for name in present:
        if f"{STAGE}/{name}" not in carried:
            problems.append(f"{STAGE}/{name} is part of the vLLM stage and no call carries it")
    for path in carried:
        if not (root / path).is_dir():
            problems.append(f"{path} is carried but the stage here has no such part "
                            f"(it has {', '.join(present) or 'none'})")
    manifest = next((stage / p / "MANIFEST" for p in present if (stage / p / "MANIFEST").is_file()), None)
    if manifest is not None:
        for kind, _sha, name, *where in (line.split() for line in manifest.read_text().splitlines() if line.strip()):
            folder = where[-1] if kind == "P" else where[0]
            if folder != "split" and f"{STAGE}/{folder}" not in carried:
                problems.append(f"MANIFEST puts {name} in {folder}, which no call carries")
    return problems


def calls_text(report: dict) -> str:
    """The call list as the lead issues it: per call, the carry list, the command and its timeout."""
    lines = [f"# the travelling tree: {report['tree_mib']} MiB; each call <= {report['limit_mib']} MiB with it; "
             f"window {report['window_s']} s (a machine start of {START_S} s + the timeouts; transfers not counted)"]
    for row in report["calls"]:
        lines.append(f"call {row['call']}: carry={json.dumps(row['carry'])} timeout_s={row['timeout_s']} "
                     f"command: {row['command']}")
        lines.append(f"    {row['carried_mib']} MiB ({'/'.join(row['sizes'])}), {row['with_tree_mib']} MiB with the "
                     f"tree: {row['work']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the parts, checked without moving them

def verify_parts(folders: list[Path]) -> list[str]:
    """sha256 of every payload file in `folders` against the stage's MANIFEST, and of each split wheel rejoined
    from its parts in name order (in memory, nothing written or moved): what join.sh checks on the card.
    Returns the lines of the check; raises ValueError naming the first mismatch."""
    manifest = next((f / "MANIFEST" for f in folders if (f / "MANIFEST").is_file()), None)
    if manifest is None:
        raise ValueError(f"no MANIFEST in {', '.join(map(str, folders))}: not vLLM stage parts (split.sh makes them)")
    entries = [line.split() for line in manifest.read_text().splitlines() if line.strip()]
    by_name = {e[2]: e for e in entries if e[0] == "P" or (e[0] == "W" and e[3] != "split")}
    lines, files = [], {}
    for folder in folders:
        for file in sorted(folder.iterdir()):
            if file.name in ("join.sh", "MANIFEST"):
                continue
            entry = by_name.get(file.name)
            if entry is None:
                raise ValueError(f"{file} is not in the MANIFEST")
            if _sha256([file]) != entry[1]:
                raise ValueError(f"{file}: sha256 differs from the MANIFEST: make the parts again (split.sh)")
            files[file.name] = file
            lines.append(f"ok  {folder.name}/{file.name}")
    for kind, sha, wheel, where in (e[:4] for e in entries if e[0] == "W" and e[3] == "split"):
        parts = sorted(e[2] for e in entries if e[0] == "P" and e[3] == wheel)
        if all(p in files for p in parts):
            if _sha256([files[p] for p in parts]) != sha:
                raise ValueError(f"{wheel} rejoined from {len(parts)} parts: sha256 differs from the MANIFEST")
            lines.append(f"ok  {wheel} rejoined from {len(parts)} parts")
    return lines


def _sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- versions, the checkpoint

DISTRIBUTIONS = ("torch", "transformers", "trl", "peft", "bitsandbytes", "unsloth", "unsloth_zoo", "vllm", "accelerate",
                 "triton", "datasets", "pydantic", "typing_extensions")


def versions() -> dict:
    """Versions of what the run uses, where each is imported from, and the card (no package is imported but torch)."""
    import importlib.metadata as md
    import importlib.util
    import platform

    found = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = None
        spec = importlib.util.find_spec(dist)
        where = None
        if spec and spec.origin:  # the folder on the path it comes from (a package's parent, a module's folder)
            where = str(Path(spec.origin).parent.parent if spec.submodule_search_locations
                        else Path(spec.origin).parent)
        found[dist] = {"version": version, "from": where}
    import torch

    found["torch_cuda"] = torch.version.cuda
    found["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        found["device"] = torch.cuda.get_device_name(0)
        found["sm"] = "sm%d%d" % torch.cuda.get_device_capability(0)
        found["device_gib"] = round(torch.cuda.mem_get_info()[1] / GIB, 2)
    return found


def stand_in_shape(dry: bool):
    """Llama-3.2-1B's shape (model_shapes.KNOWN_SHAPES: unsloth compiles LlamaForCausalLM, vLLM serves it, tied
    embeddings, 128256 tokens); `dry`: the same architecture scaled down for a CPU."""
    from lowvram_grpo.settings.model_shapes import KNOWN_SHAPES, ModelShape

    if dry:
        # Llama-3.2-1B's proportions (4 query heads per KV head, tied embeddings), small; k_proj 256 x 64 takes the
        # preset's LoRA rank 32
        return ModelShape("Llama-3.2-1B-dry", hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=512,
                          tied_embeddings=True, head_dim=32, context=2048)
    return KNOWN_SHAPES["llama-3.2-1b"]


def build(directory: Path, dry: bool, log=print) -> dict:
    """The random-weight checkpoint of stand_in_shape(dry) with the stand-in tokenizer (bench.gpu_first_run's
    build_checkpoint: the tiny BPE filled up to the vocabulary); reused when one of that shape is there."""
    from bench.gpu_first_run import build_checkpoint

    shape = stand_in_shape(dry)
    started = time.monotonic()
    build_checkpoint(shape, Path(directory), log)
    took = round(time.monotonic() - started, 1)
    facts = {"shape": shape.name, "params": shape.params, "vocab": shape.vocab, "layers": shape.layers,
             "hidden": shape.hidden, "build_s": took, "dir": str(directory)}
    log(f"checkpoint: {shape.name} ({shape.params / 1e9:.3f}B params) in {directory}, {took} s")
    return facts


# --------------------------------------------------------------------------- the run's settings

PRESET = "llama8b_4bit"  # the notebook's recipe (LoRA r=32, 6 generations, paged 8-bit AdamW, unsloth checkpointing)
RUN_SETTINGS = {  # the preset's lengths shortened so the steps fit the window: (card, dry)
    "data.dataset": ("null", "null"), "data.eval_dataset": ("null", "null"),  # built-in problems: nothing downloaded
    "data.eval_size": (16, 4), "eval.batch_size": (16, 4),
    "train.max_steps": (3, 2), "train.save_steps": (3, 2),
    "train.max_completion_length": (64, 16), "model.max_seq_length": (320, 272),
    "memory.host_allocator": ("system", "system"),  # no restart on another allocator: the observer stays in
}


def dry_preset(work: Path) -> Path:
    """PRESET's file with `requires_cuda: false` (a top-level key --set does not reach), for the CPU dry run."""
    from lowvram_grpo.settings.config import preset_path

    text = preset_path(PRESET).read_text()
    if "\nrequires_cuda: true" not in text:
        raise RuntimeError(f"the {PRESET} preset no longer says requires_cuda: true: update dry_preset")
    path = Path(work) / f"{PRESET}-dry.yaml"
    path.write_text(text.replace("\nrequires_cuda: true",
                                 "\nrequires_cuda: false  # the CPU dry run (gpu_vllm_window)"))
    return path


def run_argv(model_dir: Path, run_dir: Path, dry: bool, preset: str = PRESET) -> list[str]:
    """`python -m lowvram_grpo.run`'s arguments: the unsloth backend, 4-bit, model.fast_inference=true (dry: false:
    a CPU has no vLLM; `preset` then dry_preset's copy), the stand-in checkpoint, RUN_SETTINGS."""
    argv = ["--preset", preset, "--backend", "unsloth", "--output-dir", str(run_dir), "--overwrite",
            "--set", f"model.name={model_dir}", "--set", "memory.load_in_4bit=true",
            "--set", f"model.fast_inference={'false' if dry else 'true'}"]
    for key, values in RUN_SETTINGS.items():
        argv += ["--set", f"{key}={values[1 if dry else 0]}"]
    return argv


# --------------------------------------------------------------------------- the child: the run, observed

class Recorder:
    """What the child observes of the run, one JSON line per event in `path` (the parent reads them as they come).
    Memory through bench.gpu_first_run's CudaMemory (its CPU twin HostMemory without CUDA); the device's used
    memory sampled every 20 ms for the peaks. Peaks are kept per phase and per GRPO step."""

    def __init__(self, path: Path, memory):
        self.file = open(path, "a", buffering=1)
        self.memory = memory
        # The device's used memory. On CUDA through NVML: a CUDA runtime call (cudaMemGetInfo) from the sampling thread
        # while vLLM captures its CUDA graphs in another may be refused by the capture; without NVML it is read at the
        # phase and step boundaries only.
        self.used, self.polls = memory.used, True
        if type(memory).__name__ == "CudaMemory":
            self.used = nvml_used()
            self.polls = self.used is not None
            self.used = self.used or memory.used
        self.used_source = ("NVML, sampled every 20 ms" if self.polls and self.used is not memory.used else
                            memory.what["used"]
                            + (", sampled every 20 ms" if self.polls else ", at phase and step ends"))
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.used_peak = 0
        self.phase_acc = {"allocated": 0, "reserved": 0, "used": 0}
        self.training = False
        self.evaluating = 0    # inside ModelHandle.generate (the held-out answers): not a rollout
        self.stage = None      # the measure() stage running
        self.step: Optional[dict] = None
        self.enforce_eager = False
        self.hooked: set[str] = set()
        self.local = threading.local()
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(Exception):
                if self.polls:
                    self.used_peak = max(self.used_peak, self.used())
                if hasattr(self.memory, "sample"):
                    self.memory.sample()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def emit(self, event: str, **fields) -> None:
        with self.lock:
            self.file.write(json.dumps({"event": event, "t": self.now(), **fields}) + "\n")

    def readings(self) -> dict:
        return {"allocated": self.memory.peak_allocated(), "reserved": self.memory.peak_reserved(),
                "used": max(self.used_peak, self.used())}

    def fold(self) -> dict:
        """The peaks since the last reset, folded into the phase's; returns them (bytes)."""
        now = self.readings()
        for key, value in now.items():
            self.phase_acc[key] = max(self.phase_acc[key], value)
        return now

    def reset(self) -> None:
        self.memory.reset_peak()
        self.used_peak = self.used()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.phase_acc = {"allocated": 0, "reserved": 0, "used": 0}
        self.reset()
        started = time.monotonic()
        self.emit("phase_begin", name=name)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.fold()
            self.emit("phase_end", name=name, seconds=round(time.monotonic() - started, 3), ok=ok,
                      **{f"peak_{k}_gib": round(v / GIB, 4) for k, v in self.phase_acc.items()},
                      allocated_at_end_gib=round(self.memory.allocated() / GIB, 4))

    @contextlib.contextmanager
    def outermost(self):
        """True for the outermost of nested observed calls in this thread (LLM.chat calling generate, PEFT's
        generate calling transformers'), so a call is counted once."""
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self.local.depth = depth

    def close(self) -> None:
        self._stop.set()
        self.file.close()


def nvml_used():
    """A function giving GPU 0's used memory (every process) through NVML, or None where NVML does not answer."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # noqa: BLE001 (no NVML: the boundaries' readings only)
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used


def _wrap(owner, name: str, around) -> None:
    """owner.name becomes `around(original, *args, **kwargs)` (a function: as a class attribute it binds self)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return around(original, *args, **kwargs)

    setattr(owner, name, wrapper)


def _timed(call):
    started = time.monotonic()
    result = call()
    return result, round(time.monotonic() - started, 4)


def observe(rec: Recorder) -> None:
    """Wrap the run's steps (GRPORun), the handle's generation and LoRA calls (ModelHandle), the trainer's step
    boundaries (transformers' CallbackHandler) and transformers' generate (rollouts without vLLM). vLLM's and
    unsloth_zoo's functions are wrapped when the model loads with fast_inference (vllm_hooks). transformers is
    imported only once the run has imported unsloth (prepare_backend, before load_model): unsloth patches it on
    import."""
    from lowvram_grpo.run import pipeline
    from lowvram_grpo.model.handle import ModelHandle

    for method in ("load", "start", "train", "save", "finish"):
        def around(original, grpo, *args, _name=method, **kwargs):
            with rec.phase(_name):
                if _name == "train":
                    rec.training = True
                try:
                    return original(grpo, *args, **kwargs)
                finally:
                    rec.training = False
        _wrap(pipeline.GRPORun, method, around)

    def measure(original, grpo, stage, *args, **kwargs):
        rec.stage = stage
        try:
            with rec.phase(f"measure_{stage}"):
                return original(grpo, stage, *args, **kwargs)
        finally:
            rec.stage = None
    _wrap(pipeline.GRPORun, "measure", measure)

    def show_plan(original, grpo):
        plan = original(grpo)
        if plan is not None:
            rec.emit("plan", **plan_facts(plan))
        return plan
    _wrap(pipeline.GRPORun, "_show_memory_plan", show_plan)

    def load_model(original, resolved, *args, **kwargs):
        rec.emit("resolved", backend=resolved.backend, generation=resolved.generation,
                 fast_inference=resolved.fast_inference, load_in_4bit=resolved.load_in_4bit, dtype=resolved.dtype)
        transformers_hooks(rec)  # the backend is prepared by now (unsloth imported first where it is the backend)
        if resolved.fast_inference:
            try:
                vllm_hooks(rec)
            except Exception as exc:  # noqa: BLE001 (vLLM that does not import: the run shows what unsloth does then)
                rec.emit("vllm_hooks_failed", error=f"{type(exc).__name__}: {exc}"[:500])
        return original(resolved, *args, **kwargs)
    _wrap(pipeline, "load_model", load_model)

    def handle_generate(original, handle, *args, **kwargs):  # (prompts, sampling_params=None, lora_request=None)
        lora_request = kwargs.get("lora_request", args[2] if len(args) > 2 else None)
        rec.evaluating += 1
        try:
            completions, seconds = _timed(lambda: original(handle, *args, **kwargs))
        finally:
            rec.evaluating -= 1
        request = getattr(lora_request, "engine_request", None)
        rec.emit("generate", where="evaluation", stage=rec.stage, seconds=seconds, sequences=len(completions),
                 tokens=sum(c.num_tokens for c in completions), engine=type(handle.engine).__name__,
                 lora=getattr(lora_request, "path", None), engine_request=type(request).__name__ if request else None)
        return completions
    _wrap(ModelHandle, "generate", handle_generate)

    for method in ("save_lora", "load_lora"):
        def lora_io(original, handle, path, _name=method):
            result, seconds = _timed(lambda: original(handle, path))
            request = getattr(result, "engine_request", None)
            rec.emit(_name, seconds=seconds, path=str(path), engine=type(handle.engine).__name__,
                     engine_request=type(request).__name__ if request is not None else None,
                     engine_request_path=getattr(request, "lora_path", None) or getattr(request, "path", None))
            return result
        _wrap(ModelHandle, method, lora_io)



def transformers_hooks(rec: Recorder) -> None:
    """The trainer's step boundaries (transformers' CallbackHandler: every Trainer calls it) and transformers'
    generate (rollouts without vLLM: new positions per row, padding after an end token included)."""
    if "transformers" in rec.hooked:
        return
    rec.hooked.add("transformers")
    from transformers.generation.utils import GenerationMixin
    from transformers.trainer_callback import CallbackHandler

    def step_begin(original, handler, args, state, control, *rest, **kwargs):
        rec.fold()
        rec.reset()
        rec.step = {"started": time.monotonic(), "rollout_s": 0.0, "rollout_calls": 0, "rollout_tokens": 0,
                    "rollout_sequences": 0, "lora_sync_s": 0.0, "lora_syncs": 0, "vllm_adapter_load_s": 0.0,
                    "vllm_adapter_loads": 0}
        return original(handler, args, state, control, *rest, **kwargs)
    _wrap(CallbackHandler, "on_step_begin", step_begin)

    def step_end(original, handler, args, state, control, *rest, **kwargs):
        step, rec.step = rec.step, None
        if step is not None:
            peaks = rec.fold()
            started = step.pop("started")
            rec.emit("step", step=state.global_step, seconds=round(time.monotonic() - started, 3),
                     **{k: round(v, 4) if isinstance(v, float) else v for k, v in step.items()},
                     **{f"peak_{k}_gib": round(v / GIB, 4) for k, v in peaks.items()})
        return original(handler, args, state, control, *rest, **kwargs)
    _wrap(CallbackHandler, "on_step_end", step_end)

    def hf_generate(original, model, *args, **kwargs):
        with rec.outermost() as outer:
            if not (outer and rec.training and not rec.evaluating and rec.step is not None):
                return original(model, *args, **kwargs)
            inputs = next((x for x in (kwargs.get("input_ids"), kwargs.get("inputs"), *args[:1]) if x is not None),
                          None)
            out, seconds = _timed(lambda: original(model, *args, **kwargs))
            sequences = getattr(out, "sequences", out)
            new = (sequences.shape[1] - inputs.shape[1]) * sequences.shape[0] if inputs is not None else 0
            _rollout(rec, seconds, new, int(sequences.shape[0]))
            return out
    _wrap(GenerationMixin, "generate", hf_generate)


def _rollout(rec: Recorder, seconds: float, tokens: int, sequences: int) -> None:
    step = rec.step
    step["rollout_s"] += seconds
    step["rollout_calls"] += 1
    step["rollout_tokens"] += int(tokens)
    step["rollout_sequences"] += sequences


def vllm_hooks(rec: Recorder) -> None:
    """unsloth_zoo's load_vllm (the engine start: time, memory, the engine's own settings), its load_lora (the
    per-step sync with load_tensors=True, the held-out adapter by path), its LoRA worker manager's _load_adapter
    (vLLM loading the adapter), and vLLM's LLM.generate (rollouts: time and generated tokens)."""
    if "vllm" in rec.hooked:
        return
    rec.hooked.add("vllm")
    import vllm
    import unsloth_zoo.vllm_utils as vllm_utils

    def load_vllm(original, *args, **kwargs):
        if rec.enforce_eager:  # --enforce-eager: through unsloth_zoo's own keyword
            kwargs["enforce_eager"] = True
        used_before = rec.used()
        llm, seconds = _timed(lambda: original(*args, **kwargs))
        asked = {k: kwargs.get(k) for k in ("gpu_memory_utilization", "max_seq_length", "max_lora_rank",
                                           "use_bitsandbytes", "enforce_eager", "float8_kv_cache",
                                           "unsloth_vllm_standby")}
        rec.emit("engine", seconds=seconds, used_before_gib=round(used_before / GIB, 4),
                 used_after_gib=round(rec.used() / GIB, 4), total_gib=round(rec.memory.total() / GIB, 4),
                 asked=asked, vllm=engine_facts(llm, kwargs.get("config")), vllm_version=vllm.__version__)
        return llm
    _wrap(vllm_utils, "load_vllm", load_vllm)

    def load_lora(original, model, save_directory, *args, **kwargs):
        request, seconds = _timed(lambda: original(model, save_directory, *args, **kwargs))
        tensors = bool(kwargs.get("load_tensors", args[0] if args else False))
        if rec.step is not None and not rec.evaluating:
            rec.step["lora_sync_s"] += seconds
            rec.step["lora_syncs"] += 1
        else:
            rec.emit("unsloth_load_lora", seconds=seconds, load_tensors=tensors, path=str(save_directory),
                     stage=rec.stage)
        return request
    _wrap(vllm_utils, "load_lora", load_lora)

    with contextlib.suppress(ImportError, AttributeError):  # vLLM loading an adapter: unsloth_zoo's manager class
        from unsloth_zoo.vllm_lora_worker_manager import WorkerLoRAManager

        def load_adapter(original, manager, request, *args, **kwargs):
            result, seconds = _timed(lambda: original(manager, request, *args, **kwargs))
            if rec.step is not None and not rec.evaluating:
                rec.step["vllm_adapter_load_s"] += seconds
                rec.step["vllm_adapter_loads"] += 1
            else:
                rec.emit("vllm_adapter_load", seconds=seconds, stage=rec.stage)
            return result
        _wrap(WorkerLoRAManager, "_load_adapter", load_adapter)

    for method in ("generate", "chat"):
        def llm_call(original, llm, *args, _name=method, **kwargs):
            with rec.outermost() as outer:
                if not (outer and rec.training and not rec.evaluating and rec.step is not None):
                    return original(llm, *args, **kwargs)
                outputs, seconds = _timed(lambda: original(llm, *args, **kwargs))
                tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
                _rollout(rec, seconds, tokens, sum(len(o.outputs) for o in outputs))
                return outputs
        _wrap(vllm.LLM, method, llm_call)


def engine_facts(llm, hf_config=None) -> dict:
    """vLLM's own settings for the engine unsloth started (what unsloth_zoo decided: its share, max_model_len,
    the KV cache it got); each read as found, None where this vLLM names it otherwise."""
    vc = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    cache, model, sched, comp = (getattr(vc, n, None) for n in ("cache_config", "model_config", "scheduler_config",
                                                                 "compilation_config"))
    facts = {"gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
             "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None), "block_size": getattr(cache, "block_size", None),
             "max_model_len": getattr(model, "max_model_len", None),
             "quantization": getattr(model, "quantization", None),
             "enforce_eager": getattr(model, "enforce_eager", None),
             "max_num_seqs": getattr(sched, "max_num_seqs", None),
             "compilation": str(getattr(comp, "mode", getattr(comp, "level", None))),
             "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None))}
    if hf_config is not None and facts["num_gpu_blocks"] and facts["block_size"]:
        text = getattr(hf_config, "text_config", hf_config)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        per_token = 2 * text.num_hidden_layers * (text.num_key_value_heads or heads) * head_dim * 2  # bf16/fp16 K and V
        facts["kv_cache_gib"] = round(facts["num_gpu_blocks"] * facts["block_size"] * per_token / GIB, 4)
        facts["kv_cache_tokens"] = facts["num_gpu_blocks"] * facts["block_size"]
    return facts


def plan_facts(plan) -> dict:
    """The memory plan the run printed: its total, its terms, and what it gives vLLM (weights + the vllm term: the
    share unsloth_zoo reserves), the KV cache and max_model_len it expects."""
    terms = {k: round(t.gib, 4) for k, t in plan.terms.items()}
    share = terms.get("vllm", 0.0) + terms.get("weights", 0.0) if "vllm" in terms else None
    return {"total_gib": round(plan.total_gb, 4), "terms": terms, "card_gib": plan.vram_gb, "free_gib": plan.free_gb,
            "vllm_share_gib": round(share, 4) if share is not None else None,
            "kv_cache_gib": round(plan.kv_cache_bytes / GIB, 4) if plan.kv_cache_bytes is not None else None,
            "vllm_max_model_len": plan.vllm_max_model_len}


def child(job: dict) -> int:
    """The run, observed: the Recorder's hooks, then lowvram_grpo.run's main with job['argv']."""
    from bench.gpu_first_run import device_memory

    rec = Recorder(Path(job["events"]), device_memory())
    rec.enforce_eager = bool(job.get("enforce_eager"))
    rec.emit("start", pid=os.getpid(), memory={**rec.memory.what, "used": rec.used_source})
    observe(rec)
    from lowvram_grpo.run.cli import main

    code = main(job["argv"])
    rec.emit("exit", code=code)
    rec.close()
    return code


# --------------------------------------------------------------------------- the report

def summarize(events: list[dict]) -> dict:
    """The report's measured part from the child's events: phases, the engine start and vLLM's share against the
    plan, rollout ms per token and the LoRA sync per step, step times, the held-out answers, save/load_lora, and
    the peak against the plan's total."""
    out = {"plan": None, "resolved": None, "engine": None, "phases": {}, "steps": [], "evaluation": {}, "lora": {},
           "exit_code": None}
    for e in events:
        kind = e["event"]
        fields = {k: v for k, v in e.items() if k not in ("event",)}
        if kind == "plan":
            out["plan"] = {k: v for k, v in fields.items() if k != "t"}
        elif kind == "resolved":
            out["resolved"] = {k: v for k, v in fields.items() if k != "t"}
        elif kind == "engine":
            out["engine"] = fields
        elif kind == "phase_end":
            out["phases"][e["name"]] = {k: v for k, v in fields.items() if k != "name"}
        elif kind == "step":
            out["steps"].append(fields)
        elif kind == "generate" and e.get("where") == "evaluation":
            row = out["evaluation"].setdefault(e.get("stage") or "other", {
                "calls": 0, "seconds": 0.0, "sequences": 0, "tokens": 0, "engine": e["engine"], "lora": []})
            row["calls"] += 1
            row["seconds"] = round(row["seconds"] + e["seconds"], 4)
            row["sequences"] += e["sequences"]
            row["tokens"] += e["tokens"]
            if e.get("lora") and e["lora"] not in row["lora"]:
                row["lora"].append(e["lora"])
            row["engine_request"] = e.get("engine_request")
        elif kind in ("save_lora", "load_lora", "unsloth_load_lora", "vllm_adapter_load"):
            out["lora"].setdefault(kind, []).append(fields)
        elif kind == "start":
            out["memory_source"] = e.get("memory")
        elif kind == "vllm_hooks_failed":
            out["vllm_hooks_failed"] = e["error"]
        elif kind == "exit":
            out["exit_code"] = e["code"]
    for row in out["evaluation"].values():
        row["ms_per_token"] = round(1000 * row["seconds"] / row["tokens"], 3) if row["tokens"] else None
    steps = out["steps"]
    for step in steps:
        step["rollout_ms_per_token"] = (round(1000 * step["rollout_s"] / step["rollout_tokens"], 3)
                                        if step.get("rollout_tokens") else None)
    mean = (lambda xs: round(sum(xs) / len(xs), 4) if xs else None)
    steady = steps[1:]
    out["step_times"] = {
        "first_step_s": steps[0]["seconds"] if steps else None,
        "steady_step_s_mean": mean([s["seconds"] for s in steady]),
        "steady_rollout_ms_per_token": mean([s["rollout_ms_per_token"] for s in steady if s["rollout_ms_per_token"]]),
        "lora_sync_s_per_step": mean([s["lora_sync_s"] + s["vllm_adapter_load_s"] for s in steps]),
        "steps": len(steps)}
    peaks = [p for p in out["phases"].values()]
    if peaks:
        out["peak_gib"] = {k: max(p.get(f"peak_{k}_gib", 0) for p in peaks) for k in ("allocated", "reserved", "used")}
    plan, engine = out["plan"], out["engine"]
    if plan and out.get("peak_gib"):
        out["peak_vs_plan"] = {k: round(v / plan["total_gib"], 3) for k, v in out["peak_gib"].items()}
    if plan and engine and plan.get("vllm_share_gib"):
        vllm = engine.get("vllm") or {}
        got = vllm.get("gpu_memory_utilization")
        share = got * engine["total_gib"] if got else None
        out["vllm_share_vs_plan"] = {
            "planned_gib": plan["vllm_share_gib"], "engine_utilization": got,
            "engine_share_gib": round(share, 4) if share else None,
            "engine_share_vs_plan": round(share / plan["vllm_share_gib"], 3) if share else None,
            "used_by_the_start_gib": round(engine["used_after_gib"] - engine["used_before_gib"], 4),
            "kv_cache_gib": vllm.get("kv_cache_gib"), "planned_kv_cache_gib": plan.get("kv_cache_gib"),
            "max_model_len": vllm.get("max_model_len"), "planned_max_model_len": plan.get("vllm_max_model_len")}
    return out


def run_facts(run_dir: Path) -> dict:
    """What the run wrote: summary.json's status, steps and held-out numbers, TRL's step_time per step."""
    facts = {"dir": str(run_dir)}
    summary = run_dir / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        facts.update(status=data.get("status"), steps=data.get("steps"), train_seconds=data.get("train_seconds"),
                     total_seconds=data.get("total_seconds"), trainer=(data.get("grpo_settings") or {}).get("trainer"))
        for stage in ("before", "after"):
            if data.get(stage):
                facts[stage] = {k: data[stage].get(k) for k in ("accuracy_strict", "reward_mean",
                                                                 "mean_completion_tokens", "n")}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        facts["trl_step_time_s"] = [round(r["step_time"], 3) for r in rows if "step_time" in r]
        facts["completion_mean_length"] = [r.get("completions/mean_length") for r in rows]
    facts["adapter"] = (run_dir / "adapter" / "adapter_config.json").is_file()
    return facts


def write_json(path: Path, data: dict) -> None:
    """Atomically (bench.gpu_first_run's writer): a cut window leaves the last whole JSON."""
    from bench.gpu_first_run import write_json as atomic

    atomic(path, data)


def holds(report: dict, dry: bool) -> list[str]:
    """What the window must show, unmet: the run complete, GRPO steps, the held-out answers before (base) and after
    (the adapter as a LoRA request); on the card also the engine start, rollouts through vLLM with a LoRA sync each
    step, and the plan."""
    m, run = report.get("measured") or {}, report.get("run") or {}
    missing = []
    if m.get("exit_code") != 0 or run.get("status") != "complete":
        missing.append(f"the run did not complete (exit {m.get('exit_code')}, status {run.get('status')})")
    if not m.get("steps"):
        missing.append("no GRPO step was measured")
    after = (m.get("evaluation") or {}).get("after") or {}
    if not after.get("lora"):
        missing.append("the held-out answers after GRPO did not go through the adapter's LoRA request")
    if not (m.get("lora") or {}).get("save_lora") or not (m.get("lora") or {}).get("load_lora"):
        missing.append("save_lora / load_lora were not both called")
    if not dry:
        if m.get("vllm_hooks_failed"):
            missing.append(f"vLLM could not be observed ({m['vllm_hooks_failed']})")
        if not m.get("engine"):
            missing.append("unsloth did not start vLLM (no load_vllm)")
        if not any(s.get("rollout_tokens") for s in m.get("steps", [])):
            missing.append("no rollout went through vLLM's LLM.generate")
        if not any(s.get("lora_syncs") for s in m.get("steps", [])):
            missing.append("no per-step LoRA sync (unsloth_zoo load_lora with load_tensors) was seen")
        if after.get("engine") != "VLLMEngine":
            missing.append("the held-out answers were not generated by vLLM")
        if not m.get("plan"):
            missing.append("the run printed no memory plan")
    return missing


KILL_AFTER_S = 40  # a run asked to stop (SIGTERM) ends at its next safe point; killed after this


def run_window(args, log=print) -> int:
    """The parent: the child's run inside --budget-s, the JSON rewritten whenever an event comes."""
    from lowvram_grpo.core.errors import ConfigError

    out, model_dir = Path(args.out), Path(args.model_dir)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: name a .json file")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model-dir {model_dir} has no checkpoint: build it first with "
                          f"python -m bench.gpu_vllm_window build {model_dir}{' --dry' if args.dry else ''}")
    out.parent.mkdir(parents=True, exist_ok=True)
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="gpu-vllm-window-"))  # nothing beside --out: the card returns 8 files
    events_path = Path(args.events) if args.events else work / "events.jsonl"
    run_dir = Path(args.run_dir) if args.run_dir else work / "run"
    events_path.parent.mkdir(parents=True, exist_ok=True)
    events_path.write_text("")
    argv = run_argv(model_dir, run_dir, args.dry, str(dry_preset(work)) if args.dry else PRESET)
    started = time.monotonic()
    report = {"window": "bench/gpu_vllm_window.py (issue 55)", "dry": args.dry, "budget_s": args.budget_s,
              "command": "python -m lowvram_grpo.run " + shlex.join(argv), "enforce_eager": args.enforce_eager,
              "versions": versions(), "checkpoint": _json_or_none(model_dir / "stand_in.json"),
              "calls": _calls_log(args.calls_log),
              "install": _json_or_none(Path(args.install)) if args.install else None,
              "measured": None, "run": None, "elapsed_s": 0.0}
    write_json(out, report)
    job = {"argv": argv, "events": str(events_path), "enforce_eager": args.enforce_eager}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_vllm_window", "child", json.dumps(job)], cwd=REPO,
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    errors: list[str] = []

    def pump():
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.startswith("error:"):
                errors.append(line.strip())

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    seen, stopped, deadline = -1, None, started + args.budget_s
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        size = events_path.stat().st_size
        if size != seen or proc.poll() is not None:
            seen = size
            report["measured"] = summarize(_events(events_path))
            report["elapsed_s"] = round(time.monotonic() - started, 1)
            write_json(out, report)
        if proc.poll() is not None:
            break
        if stopped is None and time.monotonic() > deadline:
            stopped = "budget"
            log(f"window: the budget of {args.budget_s} s is over: SIGTERM to the run "
                f"(it stops at its next safe point)")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        elif stopped == "budget" and time.monotonic() > deadline + KILL_AFTER_S:
            stopped = "budget (killed)"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    pumper.join(timeout=5)
    report["measured"] = summarize(_events(events_path))
    report["run"] = run_facts(run_dir)
    report["exit_code"] = proc.returncode
    report["error_line"] = errors[-1] if errors else None
    if stopped:
        report["stopped"] = stopped
    report["missing"] = holds(report, args.dry)
    report["ok"] = not report["missing"]
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write_json(out, report)
    print_summary(report, log)
    if not report["ok"]:
        from lowvram_grpo.core.errors import TrainingStopped

        raise TrainingStopped(f"the window's run did not show everything: {'; '.join(report['missing'])}"
                              f"{' (' + report['error_line'] + ')' if report['error_line'] else ''}; {out} holds "
                              f"what was measured")
    return 0


def _events(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def _json_or_none(path: Path):
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def _calls_log(path: Optional[str]) -> Optional[list[str]]:
    """The window's steps so far (each call's lines with the machine's clock, kept between calls)."""
    if not path or not Path(path).is_file():
        return None
    return Path(path).read_text().splitlines()


def print_summary(report: dict, log=print) -> None:
    m = report.get("measured") or {}
    times, engine, share = m.get("step_times") or {}, m.get("engine") or {}, m.get("vllm_share_vs_plan") or {}
    log(f"\nwindow: run exit {report.get('exit_code')}, status {(report.get('run') or {}).get('status')}, "
        f"{times.get('steps', 0)} steps; step 1 {times.get('first_step_s')} s, "
        f"steady {times.get('steady_step_s_mean')} s")
    if engine:
        log(f"  vLLM engine start {engine.get('seconds')} s; utilization {share.get('engine_utilization')} = "
            f"{share.get('engine_share_gib')} GiB against the plan's {share.get('planned_gib')} GiB")
    log(f"  rollout {times.get('steady_rollout_ms_per_token')} ms/token (steady steps); LoRA sync "
        f"{times.get('lora_sync_s_per_step')} s/step; peak {m.get('peak_gib')} vs plan {m.get('peak_vs_plan')}")
    for line in report.get("missing") or []:
        log(f"  missing: {line}")


# --------------------------------------------------------------------------- the command line

def build_parser():
    from lowvram_grpo.core.commands import ArgumentParser, whole_number_at_least

    p = ArgumentParser(prog="python -m bench.gpu_vllm_window", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("calls", help="the call list, checked against this checkout")
    c.add_argument("--root", default=str(REPO), help="the checkout (default: this one)")
    c.add_argument("--require", action="store_true", help="the carried folders must be here (before the window)")
    c.add_argument("--json", help="also write the check to this file")
    v = sub.add_parser("verify", help="the vLLM parts' sha256 against their MANIFEST, nothing moved (dry mode)")
    v.add_argument("folders", nargs="+")
    sub.add_parser("versions", help="versions and the card, as JSON")
    b = sub.add_parser("build", help="the random-weight checkpoint")
    b.add_argument("directory")
    b.add_argument("--dry", action="store_true", help="a scaled-down Llama (a CPU)")
    r = sub.add_parser("run", help="the measured run")
    r.add_argument("--out", required=True, help="the JSON, rewritten after every phase and step")
    r.add_argument("--model-dir", required=True, help="the checkpoint `build` made")
    r.add_argument("--budget-s", type=whole_number_at_least(10), default=360, help="seconds the run may take")
    r.add_argument("--run-dir", help="the run's folder (default: beside --out)")
    r.add_argument("--events", help="the child's events, one JSON line each (default: a temporary folder)")
    r.add_argument("--calls-log", help="the window's steps file, kept on the machine between calls")
    r.add_argument("--install", help="the install step's JSON (call 4)")
    r.add_argument("--dry", action="store_true", help="a CPU: model.fast_inference=false, no vLLM")
    r.add_argument("--enforce-eager", action="store_true", help="start vLLM without compilation or CUDA graphs "
                   "(unsloth_zoo load_vllm's enforce_eager); off: the start a user gets")
    t = sub.add_parser("timeout", help="a call's timeout_s (the window script sizes the last call's run with it)")
    t.add_argument("call", type=int, choices=[c.number for c in CALLS])
    sub.add_parser("child").add_argument("job")
    return p


def main(argv=None) -> int:
    from lowvram_grpo.core.commands import guarded
    from lowvram_grpo.core.errors import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.what == "child":
        return child(json.loads(args.job))

    def body() -> int:
        if args.what == "calls":
            if not (Path(args.root) / ".git").exists():
                raise ConfigError(f"--root {args.root} is not a git checkout")
            report = check_calls(Path(args.root), require=args.require)
            print(calls_text(report))
            if args.json:
                write_json(Path(args.json), report)
            if report["problems"]:
                raise ConfigError("the call list does not hold: " + "; ".join(report["problems"]))
            return 0
        if args.what == "verify":
            try:
                print("\n".join(verify_parts([Path(f) for f in args.folders])))
            except (ValueError, OSError) as exc:
                raise ConfigError(f"the vLLM parts: {exc}") from None
            return 0
        if args.what == "timeout":
            print(next(c.timeout_s for c in CALLS if c.number == args.call))
            return 0
        if args.what == "versions":
            print(json.dumps(versions(), indent=2))
            return 0
        if args.what == "build":
            facts = build(Path(args.directory), args.dry)
            write_json(Path(args.directory) / "stand_in.json", facts)
            return 0
        if args.enforce_eager and args.dry:
            raise ConfigError("--enforce-eager is for vLLM on the card; --dry runs no vLLM")
        return run_window(args)

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
