"""The first-run kit: what a CUDA card runs first, in minutes, with no model hub: the memory plan measured.

    python -m bench.gpu_first_run --preset llama8b_4bit                  # every variant installed here
    python -m bench.gpu_first_run --preset qwen1_5b_4bit --variants hf-nf4 --steps 2
    python -m bench.gpu_first_run --preset tiny                          # the same code on a CPU (the test suite)

1. A random-weight checkpoint of the preset's model shape (model_shapes.model_shape, the table the plan uses;
   memory and speed do not depend on the values) with a stand-in tokenizer of the model's vocabulary size
   (the tiny model's BPE, filled up to that size), in a temporary folder (`--model-dir` keeps it for reuse).
   The system prompt is padded so the longest prompt is just under train.max_prompt_length, and random
   weights rarely sample the end token, so sequences reach the lengths the plan counts.
2. Each variant in a fresh process, loaded and trained as a run is (pipeline.GRPORun, the package's
   backends) with the preset's settings for `--steps` GRPO steps, a checkpoint each step, the held-out
   evaluation of the trained adapter (one batch of eval.batch_size questions): `hf-nf4` (hf backend, bitsandbytes
   NF4, transformers
   generation; always), `unsloth` (the preset's own unsloth settings, vLLM where installed) and `hf-vllm`
   (hf backend, model.generation=vllm) when installed. Per phase (load, rollout = generation inside
   training, training step = everything else in training, evaluation): peak allocated and reserved memory,
   the device's used memory (all processes: vLLM's engine too) at its peak and at the phase's end, the
   time; beside them the plan's terms (memory.plan), the step times, the dtype and optimizer really used,
   the checkpoint's size on disk against doctor's estimate.
3. The cap: `hf-nf4` again, through the CLI (lowvram_grpo.run.cli.main), capped after its first checkpoint
   below what its measured step needs (torch.cuda.set_per_process_memory_fraction): it must end with the
   package's out-of-memory line (exit 1) and keep the checkpoint; then `python -m lowvram_grpo.run --resume
   RUN` with the cap lifted must finish it.
4. One JSON (`--out`, default bench/results/gpu_first_run-PRESET.json).

Without CUDA, `HostMemory` is the CPU twin of the CUDA calls, so no branch is GPU-only: allocated = the
bytes glibc's malloc has handed out and not had back (mallinfo2), reserved = the process's peak RSS, used =
RSS, peaks sampled every 10 ms; the cap is a module forward hook that raises torch.cuda.OutOfMemoryError
once allocated passes it, where CUDA's allocator would raise it.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from lowvram_grpo.core.commands import whole_number_at_least

REPO = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
VARIANTS = ("unsloth", "hf-nf4", "hf-vllm")  # also the order they run in: what matters most first
NEEDS = {"hf-nf4": "bitsandbytes", "unsloth": "unsloth", "hf-vllm": "vllm"}
CAP_SHARE = 0.25      # the cap: what the process holds between steps + this share of what a step adds on top
WEIGHT_SEED = 0
SHARD_BYTES = 2 * GIB  # the stand-in checkpoint's safetensors shards
RANDOM_BLOCK = 2 ** 24  # random values drawn for the stand-in checkpoint (copied into every matrix)


# --------------------------------------------------------------------------- device memory: CUDA, and its CPU twin

class CudaMemory:
    """torch.cuda's allocator statistics and cap, for device 0."""

    what = {"allocated": "torch.cuda.max_memory_allocated", "reserved": "torch.cuda.max_memory_reserved",
            "used": "device memory in use by every process (total - torch.cuda.mem_get_info free)"}

    def __init__(self):
        import torch

        self.torch = torch

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated()

    def peak_allocated(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def peak_reserved(self) -> int:
        return self.torch.cuda.max_memory_reserved()

    def used(self) -> int:
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def total(self) -> int:
        return self.torch.cuda.get_device_properties(0).total_memory

    def cap(self, limit: int) -> None:
        self.torch.cuda.empty_cache()  # cached blocks would otherwise serve allocations past the cap
        self.torch.cuda.set_per_process_memory_fraction(min(limit / self.total(), 1.0))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


class HostMemory:
    """The CPU twin: glibc's in-use heap (mallinfo2) for allocated, peak RSS for reserved, RSS for used; its
    cap raises CUDA's out-of-memory error from a module's forward once allocated passes the limit."""

    what = {"allocated": "glibc malloc in use (mallinfo2 uordblks + hblkhd), sampled every 10 ms",
            "reserved": "process peak RSS (VmHWM)", "used": "process RSS"}

    def __init__(self):
        self.libc = ctypes.CDLL(None)
        self.libc.mallinfo2.restype = _Mallinfo2
        self._peak = 0
        self.limit: Optional[int] = None

    def allocated(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def sample(self) -> None:
        self._peak = max(self._peak, self.allocated())

    def reset_peak(self) -> None:
        self._peak = self.allocated()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM

    def peak_allocated(self) -> int:
        self.sample()
        return self._peak

    def peak_reserved(self) -> int:
        return _proc_status("VmHWM")

    def used(self) -> int:
        return _proc_status("VmRSS")

    def total(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def cap(self, limit: int) -> None:
        import torch

        self.limit = limit

        def over_the_cap(module, args):
            if self.limit is not None and self.allocated() > self.limit:
                raise torch.cuda.OutOfMemoryError(
                    f"CUDA out of memory (the kit's CPU cap): {self.allocated() / GIB:.3f} GiB allocated past the "
                    f"cap of {self.limit / GIB:.3f} GiB")

        torch.nn.modules.module.register_module_forward_pre_hook(over_the_cap)


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def device_memory():
    import torch

    return CudaMemory() if torch.cuda.is_available() else HostMemory()


# The kit's parent asks torch nothing about the device: a CUDA context opened there (torch.cuda.mem_get_info opens
# one; so does any CUDA tensor) would stay open while every child runs, and each child's measured device memory
# (`used`: every process's) would include its ~0.3-0.5 GiB. The card's facts are read by hardware.detect() in a
# child process, which exits (its context with it) before the first variant starts.
FACTS_CHILD = ("import dataclasses, json, sys, torch\n"
               "from lowvram_grpo.settings.hardware import detect\n"
               "print('KIT-FACTS ' + json.dumps({'hardware': dataclasses.asdict(detect()), 'torch': torch.__version__, "
               "'torch_cuda': torch.version.cuda}))")
FACTS_TIMEOUT_S = 180.0  # a child's Python start, torch's import and the CUDA driver's start


def read_hardware() -> tuple:
    """(hardware.Hardware, {'torch', 'torch_cuda'}) of this machine, read by `hardware.detect()` in a child
    process (FACTS_CHILD), so the calling process opens no CUDA context. Raises LowvramError when the child fails."""
    from lowvram_grpo.core.errors import LowvramError
    from lowvram_grpo.settings.hardware import Hardware

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run([sys.executable, "-c", FACTS_CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=FACTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LowvramError(f"reading the card's facts (hardware.detect() in a child process) took over "
                           f"{FACTS_TIMEOUT_S:.0f} s: check the card with nvidia-smi") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KIT-FACTS ")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise LowvramError(f"reading the card's facts (hardware.detect() in a child process) failed with exit "
                           f"{proc.returncode}: {last}")
    facts = json.loads(lines[-1].removeprefix("KIT-FACTS "))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in facts["hardware"].items()}  # JSON's lists
    return Hardware(**fields), {"torch": facts["torch"], "torch_cuda": facts["torch_cuda"]}


class Phases:
    """Peak memory and time per phase. `switch(name)` closes the current phase and starts `name`; a poller
    samples the device's used memory (and the CPU twin's allocated bytes) every 10 ms for the peaks."""

    def __init__(self, memory, on_change=None):
        self.memory = memory
        self.on_change = on_change  # called (no arguments) after a phase or a step's training part closes
        self.results: dict[str, dict] = {}
        self.current: Optional[str] = None
        self.started = time.time()
        self.used_peak = 0
        self.steps: list[dict] = []
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            with contextlib.suppress(Exception):
                self.used_peak = max(self.used_peak, self.memory.used())
                if isinstance(self.memory, HostMemory):
                    self.memory.sample()

    def switch(self, name: Optional[str]) -> None:
        now = time.time()
        if self.current is not None:
            used_now = self.memory.used()
            row = self.results.setdefault(self.current, {"peak_allocated": 0, "peak_reserved": 0, "used_peak": 0,
                                                         "used_at_end": 0, "seconds": 0.0, "times": 0})
            row["peak_allocated"] = max(row["peak_allocated"], self.memory.peak_allocated())
            row["peak_reserved"] = max(row["peak_reserved"], self.memory.peak_reserved())
            row["used_peak"] = max(row["used_peak"], self.used_peak, used_now)
            row["used_at_end"] = used_now
            row["seconds"] += now - self.started
            row["times"] += 1
        last = self.steps[-1] if self.steps else None
        if self.current == "rollout" and last:
            last["rollout_s"] = round(now - last["_start"], 3)
        elif self.current == "training" and last and last["training_s"] is None and last["rollout_s"] is not None:
            last["training_s"] = round(now - last["_start"] - last["rollout_s"], 3)
        closed = self.current is not None and (name is None or name == "rollout")
        if name == "rollout":  # a step starts with its rollout; what is held then stays through the step
            self.steps.append({"step": len(self.steps) + 1, "rollout_s": None, "training_s": None,
                               "held_gib": round(self.memory.allocated() / GIB, 4), "_start": now})
        self.memory.reset_peak()
        self.used_peak = self.memory.used()
        self.current, self.started = name, now
        if closed and self.on_change is not None:
            self.on_change()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.switch(name)
        try:
            yield
        finally:
            self.switch(None)

    def watch_generation(self, owner, method: str = "generate") -> None:
        """Generation called during training is the rollout; the rest of training is the training step.
        `owner`: a class (its function is wrapped) or an object (its bound method, as an attribute of its own)."""
        original = getattr(owner, method)
        phases = self

        @functools.wraps(original)
        def generate(*args, **kwargs):
            if phases.current != "training":
                return original(*args, **kwargs)
            phases.switch("rollout")
            try:
                return original(*args, **kwargs)
            finally:
                phases.switch("training")

        setattr(owner, method, generate)

    def finished_steps(self) -> list[dict]:
        """The steps whose rollout and training both closed, without their start stamps."""
        return [{k: v for k, v in s.items() if k != "_start"} for s in self.steps
                if s["rollout_s"] is not None and s["training_s"] is not None]

    def snapshot(self) -> dict:
        """The phases closed so far, in GiB and seconds (the poller keeps running)."""
        return {name: {**{k: round(v / GIB, 5) for k, v in row.items() if k not in ("seconds", "times")},
                       "seconds": round(row["seconds"], 2), "times": row["times"]}
                for name, row in self.results.items()}

    def close(self) -> dict:
        self._stop.set()
        return self.snapshot()


def step_times(steps: list[dict]) -> dict:
    """The first GRPO step apart (on CUDA it includes compilation: unsloth compiles each decoder block on first
    use, TRL's and torch's kernels compile too) from the steady steps after it; rollout and training apart."""
    if not steps:
        return {"first_step_s": None, "steady_step_s_mean": None, "steady_steps": 0}
    total = [s["rollout_s"] + s["training_s"] for s in steps]
    steady = steps[1:]
    mean = (lambda xs: round(statistics.fmean(xs), 3) if xs else None)
    return {"first_step_s": round(total[0], 3), "first_step_rollout_s": steps[0]["rollout_s"],
            "first_step_training_s": steps[0]["training_s"], "steady_step_s_mean": mean(total[1:]),
            "steady_rollout_s_mean": mean([s["rollout_s"] for s in steady]),
            "steady_training_s_mean": mean([s["training_s"] for s in steady]), "steady_steps": len(steady),
            "first_step_extra_s": round(total[0] - statistics.fmean(total[1:]), 3) if steady else None}


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a kill at any moment) sees the previous file or this one, never half of one."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(staging, path)


# --------------------------------------------------------------------------- the stand-in checkpoint

def stand_in_tokenizer(vocab: int):
    """The tiny model's byte-level BPE (chat template, specials) with filler tokens up to `vocab` ids: text
    encodes as in builtin:tiny, every id a random model samples decodes (to '<id>'; the last to '<|endoftext|>')."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    tiny = AutoTokenizer.from_pretrained(ensure_tiny_model())
    data = json.loads(tiny.backend_tokenizer.to_str())
    table = data["model"]["vocab"]
    if vocab < len(tiny):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the stand-in tokenizer's own {len(tiny)}")
    next_id = max(table.values()) + 1
    while next_id < vocab:
        # the last id is Qwen2's <|endoftext|>: its tokenizer class would add it past the vocabulary otherwise
        token = "<|endoftext|>" if next_id == vocab - 1 else f"<{next_id}>"
        if token not in table:
            table[token] = next_id
            next_id += 1
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token=tiny.bos_token,
                                        eos_token=tiny.eos_token, pad_token=tiny.pad_token, model_max_length=32768)
    tokenizer.chat_template = tiny.chat_template
    assert len(tokenizer) == vocab, (len(tokenizer), vocab)
    return tokenizer


def build_checkpoint(shape, directory: Path, log=print) -> Path:
    """A random bf16 checkpoint of `shape` (a model_shapes.ModelShape) with the stand-in tokenizer, in `directory`;
    kept when one of this shape is there already. Written tensor by tensor in safetensors shards of at most
    SHARD_BYTES, so building Llama-3.1-8B's 16 GB needs ~2 GB of RAM (a Colab runtime has 12); on the CPU."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoConfig

    from lowvram_grpo.settings.model_shapes import model_shape

    directory = Path(directory)
    if (directory / "config.json").is_file() and _same_shape(model_shape(str(directory)), shape):
        log(f"reusing the stand-in checkpoint in {directory}")
        return directory
    log(f"building a random {shape.name}-shaped checkpoint ({shape.params / 1e9:.2f}B params, bf16) in {directory} ...")
    tokenizer = stand_in_tokenizer(shape.vocab)
    fields = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=32768,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    fields["head_dim"] = shape.dim_per_head  # explicit: Qwen3's config defaults to 128, not hidden / heads
    if shape.family not in STAND_IN_FAMILIES:
        raise ValueError(f"no stand-in checkpoint for the {shape.family} family (the kit builds "
                         f"{', '.join(STAND_IN_FAMILIES)})")
    config = AutoConfig.for_model(shape.family, **fields)  # the preset's own architecture, random weights
    with torch.device("meta"):  # names and shapes only; a tied lm_head is listed once, as the embedding
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    shards, size = [[]], 0
    for name, dims in params:
        nbytes = 2 * int(torch.Size(dims).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    # N(0, 0.02) values drawn once and copied into every matrix at shifting offsets: drawing 8B numbers would
    # take minutes of CPU, and neither memory nor speed depends on the values
    block = torch.empty(2 * RANDOM_BLOCK, dtype=torch.bfloat16).normal_(
        0.0, 0.02, generator=torch.Generator().manual_seed(WEIGHT_SEED))
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims in shard:
            if name.endswith("bias"):
                tensor = torch.zeros(dims, dtype=torch.bfloat16)
            elif len(dims) == 1:
                tensor = torch.ones(dims, dtype=torch.bfloat16)  # norms
            else:
                tensor = torch.empty(dims, dtype=torch.bfloat16)
                flat = tensor.view(-1)
                for start in range(0, flat.numel(), RANDOM_BLOCK):
                    count = min(RANDOM_BLOCK, flat.numel() - start)
                    offset = (len(weight_map) * 7919 + start // RANDOM_BLOCK * 104729) % RANDOM_BLOCK
                    flat[start:start + count].copy_(block[offset:offset + count])
            tensors[name] = tensor
            weight_map[name] = file
            total += tensor.numel() * 2
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config.save_pretrained(directory)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    built = model_shape(str(directory))  # read back as the plan reads a local checkpoint
    if not _same_shape(built, shape):
        raise RuntimeError(f"the checkpoint's config.json gives {built}, not the table's {shape}")
    return directory


def _same_shape(a, b) -> bool:
    keys = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied_embeddings", "dim_per_head")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def padded_system_prompt(config, tokenizer, pad: bool = True) -> tuple[str, int]:
    """The preset's system prompt with filler words, so the longest training prompt is just under
    train.max_prompt_length tokens (the length the plan counts); and that length (`pad=False`: the preset's
    own prompt and its longest)."""
    from lowvram_grpo.task.data import load_questions, to_prompt_rows

    questions, _ = load_questions(config.data)
    sample = questions[:200]

    def longest(system: str) -> int:
        return max(len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
                   for row in to_prompt_rows(sample, system))

    limit, base = config.train.max_prompt_length, config.data.system_prompt
    now = longest(base)
    if not pad:
        return base, now
    per_word = max(longest(base + " ok" * 8) - now, 1) / 8
    words = max(int((limit - now) / per_word) - 1, 0)
    while words and longest(base + " ok" * words) > limit:
        words -= 1
    text = base + " ok" * words
    return text, longest(text)


# --------------------------------------------------------------------------- the variants

def variant_overrides(variant: str, cuda: bool, config) -> tuple[str, list[str]]:
    """(backend, --set values) of a variant on top of the preset's settings."""
    if variant == "hf-nf4":
        return "hf", ["memory.load_in_4bit=true", "model.fast_inference=false", "model.generation=transformers"]
    if variant == "unsloth":
        return "unsloth", []
    four_bit = config.memory.load_in_4bit and cuda  # vLLM's CPU build serves 16-bit weights only
    return "hf", ["model.generation=vllm", "model.fast_inference=false", f"memory.load_in_4bit={str(four_bit).lower()}"]


def _summary_of_plan(config, resolved) -> dict:
    from lowvram_grpo.core.errors import PlanError
    from lowvram_grpo.settings.memory_plan import plan

    try:
        p = plan(config, resolved)
    except PlanError as exc:
        return {"error": str(exc)}
    return {"card_gib": resolved.vram_gib, "total_gib": round(p.total_gb, 3), "min_card_gib": round(p.min_vram_gb, 3),
            "fits": p.fits, "terms": {k: {"gib": round(t.gib, 3), "label": t.label} for k, t in p.terms.items()}}


def optimizer_info(optimizer) -> dict:
    """The optimizer the trainer really built: its class, bitsandbytes' bits and paging, its state's size."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    state = sum(v.numel() * v.element_size() for s in inner.state.values() for v in s.values() if torch.is_tensor(v))
    args = getattr(inner, "args", None)
    return {"class": f"{type(inner).__module__}.{type(inner).__name__}",
            "optim_bits": getattr(args, "optim_bits", None),
            "is_paged": getattr(inner, "is_paged", None), "state_gib": round(state / GIB, 5)}


def peak_vs_plan(peak_gib: dict, plan_total_gib: float) -> dict:
    """Each measured peak (GiB) as a share of the plan's total, to 3 decimals: above 1, the plan fell short."""
    return {k: round(v / plan_total_gib, 3) for k, v in peak_gib.items()}


def measure(job: dict) -> int:
    """A child process: one variant's run, measured per phase; writes job['part']."""
    from lowvram_grpo.core.commands import guarded

    return guarded(lambda: _measure(job))


def _measure(job: dict) -> int:
    import torch

    from lowvram_grpo.core import allocator
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.doctor import checkpoint_bytes
    from lowvram_grpo.run.pipeline import GRPORun

    memory = device_memory()
    config = load_config(job["preset"], job["overrides"])
    grpo = GRPORun(config, job["run_dir"], backend=job["backend"])
    result = {"variant": job["variant"], "backend": job["backend"], "overrides": job["overrides"], "finished": False,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "memory_source": memory.what}

    def write_part() -> None:  # after every phase and step: a cut run keeps what it measured
        steps = phases.finished_steps()
        write_json(Path(job["part"]), {**result, "phases": phases.snapshot(), "steps": steps, **step_times(steps)})

    phases = Phases(memory, on_change=write_part)
    with phases.phase("load"):
        handle = grpo.load()
    resolved = grpo.resolved
    result.update(backend=resolved.backend, resolved=dict(resolved.summary()),
                  plan=_summary_of_plan(grpo.user_config, resolved), plan_lengths=plan_lengths(grpo.user_config))
    write_part()
    from transformers.generation.utils import GenerationMixin

    phases.watch_generation(GenerationMixin)
    phases.watch_generation(handle.model)  # the instance's own: unsloth binds its generate onto the model (and
    # decoding.install ours)
    if "vllm" in sys.modules:
        import vllm

        phases.watch_generation(vllm.LLM)
    grpo.start()  # the base model's evaluation is skipped: the trained adapter's (after) is the larger one
    if torch.cuda.is_available():
        print(f"kit: the first GRPO step includes compilation (unsloth compiles each decoder block on first use; "
              f"on the H100, 2026-11-26, Qwen2.5-1.5B shape at 512 tokens: step 1 {FIRST_STEP_H100['unsloth']} s on "
              f"unsloth, {FIRST_STEP_H100['hf']} s on hf, then ~30 / ~51 s): the progress bar waits there", flush=True)
    with phases.phase("training"):
        grpo.train()
    adapter = grpo.save()
    with phases.phase("evaluation"):
        grpo.measure("after", adapter)
    grpo.finish()
    measured = phases.close()
    steps = phases.finished_steps()
    dtypes: dict[str, float] = {}
    for param in handle.model.parameters():
        name = str(param.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + param.numel() * param.element_size() / GIB
    trainable = sum(p.numel() * p.element_size() for p in handle.model.parameters() if p.requires_grad)
    checkpoint = grpo.run_dir.latest_checkpoint()
    result.update({
        "finished": True, "host_allocator": allocator.active(), "phases": measured, "steps": steps, **step_times(steps),
        "step_s_median": round(statistics.median(s["rollout_s"] + s["training_s"] for s in steps), 3)
        if steps else None,
        "dtype": {"resolved": resolved.dtype, "parameter_gib_by_dtype": {k: round(v, 5) for k, v in dtypes.items()},
                  "trainable_gib": round(trainable / GIB, 5)},
        "optimizer": optimizer_info(grpo.trainer.optimizer),
        "grpo_settings": grpo.trainer.effective_settings.get("settings", {}),
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) if checkpoint else None,
        "checkpoint_bytes_doctor_estimate": int(checkpoint_bytes(resolved) // (config.train.keep_checkpoints + 1)),
    })
    peak = {k: max(row[k] for row in measured.values()) for k in ("peak_allocated", "peak_reserved", "used_peak")}
    result["peak_gib"] = peak
    if steps:  # what a GRPO step adds on top of what is held between steps (the capped run's yardstick)
        step_peak = max(measured[p]["peak_allocated"] for p in ("rollout", "training") if p in measured)
        result["step_held_gib"] = statistics.median(s["held_gib"] for s in steps)
        result["step_adds_gib"] = round(max(step_peak - result["step_held_gib"], 0.0), 4)
    total = result["plan"].get("total_gib")
    if total:
        result["peak_vs_plan"] = peak_vs_plan(peak, total)
    result["decode_graphs"] = decode_graph_record(resolved, grpo.decode_graphs, steps, grpo.run_dir.read_metrics())
    write_json(Path(job["part"]), result)
    return 0


def decode_graph_record(resolved, stats, steps: list[dict], rows: list[dict]) -> dict:
    """unsloth's decode CUDA graphs in a variant's run: resolve's decision and why, the environment variables unsloth
    reads (UNSLOTH_DECODE_CUDA_GRAPHS: set it to 0 for the same run without graphs), its counters after GRPO
    (pipeline: core.internals.decode_graph_stats, CUDA + unsloth backend; None elsewhere), and per step the rollout's
    time per decode step (rollout seconds / the longest completion: one batched forward a token) and per generated token
    (/ all completion tokens of the batch), from the kit's step times and metrics.jsonl (one row a step)."""
    import os

    from lowvram_grpo.settings.resolve import DECODE_GRAPHS_ENV

    per_step = []
    for step, row in zip(steps, rows):
        longest, mean = row.get("completions/max_length"), row.get("completions/mean_length")
        if step.get("rollout_s") and longest:
            per_step.append({"step": step["step"], "ms_per_decode_step": round(1000 * step["rollout_s"] / longest, 3),
                             "ms_per_token": round(1000 * step["rollout_s"]
                                                   / (mean * resolved.generation_batch_size), 4)
                             if mean else None})
    steady = [s["ms_per_decode_step"] for s in per_step[1:]]  # step 1 compiles (and captures)
    return {"decided": resolved.decode_graphs, "reason": resolved.decode_graphs_reason,
            "environment": {k: os.environ.get(k) for k in (DECODE_GRAPHS_ENV, "UNSLOTH_DECODE_GRAPH_PREALLOC")},
            "stats": stats, "per_step": per_step,
            "steady_ms_per_decode_step_median": round(statistics.median(steady), 3) if steady else None}


def plan_lengths(config) -> dict:
    """The lengths and sizes the memory plan was made for (the run's own: like for like with what ran)."""
    return {"train.max_prompt_length": config.train.max_prompt_length,
            "train.max_completion_length": config.train.max_completion_length,
            "model.max_seq_length": config.model.max_seq_length, "train.num_generations": config.train.num_generations,
            "eval.batch_size": config.eval.batch_size, "data.eval_size": config.data.eval_size}


def capped(job: dict) -> int:
    """A child process: the run through the CLI (lowvram_grpo.run.cli.main), capped at the first rollout after its
    first checkpoint to what it holds then + CAP_SHARE x what the measured step added on top. Writes job['part']."""
    from transformers.generation.utils import GenerationMixin

    from lowvram_grpo.run.cli import main as run_main
    from lowvram_grpo.report.run_dir import RunDir

    memory = device_memory()
    run_dir, info = RunDir(job["run_dir"]), {}
    generate = GenerationMixin.generate

    def arm() -> None:
        checkpoint = None if info else run_dir.latest_checkpoint()
        if checkpoint is not None:
            held = memory.allocated()
            limit = int(held + CAP_SHARE * job["step_adds"])
            info.update(held_gib=round(held / GIB, 4), cap_gib=round(limit / GIB, 4), armed_after=checkpoint.name,
                        how=type(memory).__name__)
            memory.cap(limit)

    @functools.wraps(generate)
    def arm_then_generate(*args, **kwargs):
        arm()
        return generate(*args, **kwargs)

    GenerationMixin.generate = arm_then_generate
    from lowvram_grpo.model import decoding  # our decode loop (decode.loop=lowvram) generates without transformers'
                                             # generate

    decode = decoding.decode

    @functools.wraps(decode)
    def arm_then_decode(*args, **kwargs):
        arm()
        return decode(*args, **kwargs)

    decoding.decode = arm_then_decode
    code = run_main(job["argv"])
    write_json(Path(job["part"]), {"exit_code": code, **info})
    return code


def resume(job: dict) -> int:
    """A child process: `python -m lowvram_grpo.run --resume RUN`, as a user types it (through run.main)."""
    from lowvram_grpo.run.cli import main as run_main

    return run_main(["--resume", job["run_dir"]])


# --------------------------------------------------------------------------- the budget

# What the first lent H100 took (2026-11-26, ../shared/gpu/2026-11-26-h100, docs/gpu.md "What has run on a GPU"): a
# Qwen2.5-1.5B-shaped 4-bit run, 6 completions of 512 tokens per step, transformers generation (no vLLM there).
FIRST_STEP_H100 = {"unsloth": 108.7, "hf": 75.4}
# The cost model the kit plans its budget with, in seconds, per device: `start` = a child's Python start, imports,
# doctor lines and loading; `step` = one steady GRPO step at `tokens` completion tokens; `compile` = what the first
# step adds; `eval` = the trained adapter's evaluation (one batch) at `tokens`; `build` = the stand-in checkpoint
# per billion parameters. CUDA's from the H100's logs (the variant's start and the evaluation bounded from the
# timeouts that cut them); the CPU's measured here for builtin:tiny (2 cores). Other shapes scale the step and
# evaluation by (params / reference) ** `power` (on CUDA transformers generation is launch-bound, so less than the
# weights grow). After each child the kit scales what is left by what it really took against its estimate.
COSTS = {
    True: {"params": 1.54e9, "tokens": 512, "power": 0.5, "load_per_b": 6.0, "build_per_b": 12.0, "build": 10.0,
           "eval": 40.0, "unsloth": {"start": 45.0, "step": 30.0, "compile": 79.0},
           "hf": {"start": 25.0, "step": 51.0, "compile": 24.0}},
    False: {"params": 139584, "tokens": 24, "power": 1.0, "load_per_b": 6.0, "build_per_b": 12.0, "build": 3.0,
            "eval": 1.0, "unsloth": {"start": 12.0, "step": 1.5, "compile": 5.0},
            "hf": {"start": 8.0, "step": 1.0, "compile": 0.5}},
}
# The kit's own start before its budget's work: Python, the imports, the card's facts read in a child (read_hardware).
KIT_START_S = {True: 20.0, False: 8.0}
KILL_GRACE_S = 5.0     # a child asked to stop (SIGTERM) is killed after this
RESERVE_S = 8.0        # kept back from every child's timeout: stopping it and writing the JSON
FIT_SHARE = 0.9        # the plan fills at most this share of the budget (the estimates are estimates)
POLL_S = 0.5           # how often the parent looks at a running child's partial figures
MIN_COMPLETION = 16    # the shortest train.max_completion_length the kit shortens to


class CostModel:
    """Seconds each piece of the kit's work takes, for one model shape on this device (COSTS), corrected by
    what the finished pieces really took (`learn`)."""

    def __init__(self, cuda: bool, params: float):
        self.c = COSTS[cuda]
        self.scale = max(params / self.c["params"], 1e-3) ** self.c["power"]
        self.params_b = params / 1e9
        self.factor = 1.0

    def build(self, reused: bool) -> float:
        return 2.0 if reused else self.c["build"] + self.c["build_per_b"] * self.params_b

    def _run(self, backend: str, steps: int, tokens: int, eval_batch: Optional[int], generations: int) -> float:
        own = self.c[backend]
        per_token = self.scale * tokens / self.c["tokens"]
        seconds = own["start"] + self.c["load_per_b"] * self.params_b + own["compile"] + own["step"] * per_token * steps
        if eval_batch:  # one batch; on a CPU the time grows with the batch, on a GPU hardly at these sizes
            seconds += self.c["eval"] * per_token * (1.0 if self.c["power"] < 1 else max(eval_batch / generations, 1.0))
        return seconds * self.factor

    def estimate(self, item: str, backend: str, steps: int, tokens: int, eval_batch: int, generations: int) -> float:
        if item == "cap":  # step 1 with its checkpoint, then the capped step 2 ends it
            return self._run("hf", 2, tokens, None, generations)
        if item == "resume":  # a fresh process compiles again, then the steps after checkpoint-1; no evaluation
            return self._run("hf", steps - 1, tokens, None, generations)
        return self._run(backend, steps, tokens, eval_batch, generations)

    def learn(self, estimated: float, took: float) -> None:
        """Scale what is left by took / estimated (bounded: one odd child must not skip everything after it)."""
        if estimated > 0 and took > 0:
            self.factor = min(max(self.factor * took / estimated, 0.3), 5.0)


def preparation_s(config, shape, variants: list[str], cuda: bool, reused: bool = False) -> dict:
    """What the kit needs of its budget before it does anything for a preset, by its cost model (COSTS): its start
    (KIT_START_S), the stand-in checkpoint's build (CostModel.build: a fixed part + seconds per billion parameters of
    the preset's shape; ~2 s when `reused`), the reserve, and the first piece of its work (the first variant it runs)
    at the shortest completions, 2 steps and one rollout's evaluation batch, over FIT_SHARE (sizing's least). Under
    `min_budget_s` the kit would build a checkpoint and run nothing. Seconds: {'start_s', 'build_s',
    'first_piece_s', 'min_budget_s', 'first_piece'}."""
    costs = CostModel(cuda, shape.params)
    first = next((v for v in variants if v != "hf-vllm"), variants[0])
    t = config.train
    piece = costs.estimate("variant", variant_overrides(first, cuda, config)[0], 2, min(t.max_completion_length,
                           MIN_COMPLETION), min(config.eval.batch_size, t.num_generations), t.num_generations)
    start, build = KIT_START_S[cuda], costs.build(reused)
    return {"start_s": start, "build_s": round(build, 1), "first_piece": first, "first_piece_s": round(piece, 1),
            "min_budget_s": round(start + build + RESERVE_S + piece / FIT_SHARE, 1)}


def min_budget_s(preset: str, cuda: bool) -> float:
    """preparation_s's `min_budget_s` for `preset` with the variants installed here (what bench/gpu_window.sh
    compares with the seconds it has left before it starts the kit)."""
    config, shape, variants = settle(argparse.Namespace(preset=preset, variants=None))
    return preparation_s(config, shape, variants, cuda)["min_budget_s"]


def sizing(work: list[tuple[str, str]], costs: CostModel, seconds: float, steps: int, tokens: int, eval_batch: int,
           generations: int) -> dict:
    """The longest completions, then the most steps (at least 2), at which the most pieces of `work` (in its
    order: what matters most first) fit FIT_SHARE of `seconds`; the evaluation batch shrinks to one rollout's
    size when the completions are shortened. {'tokens', 'steps', 'eval_batch', 'fits': pieces, 'estimates'}."""
    lengths = []
    length = tokens
    while length > MIN_COMPLETION:
        lengths.append(length)
        length //= 2
    lengths.append(min(tokens, MIN_COMPLETION))
    usable = seconds * FIT_SHARE
    for count in range(len(work), 0, -1):
        for length in lengths:
            batch = eval_batch if length == tokens else min(eval_batch, generations)
            for n in range(steps, 1, -1):
                estimates = [costs.estimate(item, backend, n, length, batch, generations) for item, backend in work]
                if sum(estimates[:count]) <= usable:
                    return {"tokens": length, "steps": n, "eval_batch": batch, "fits": count,
                            "estimates": [round(e, 1) for e in estimates]}
    batch = min(eval_batch, generations)
    return {"tokens": lengths[-1], "steps": 2, "eval_batch": batch, "fits": 0,
            "estimates": [round(costs.estimate(i, b, 2, lengths[-1], batch, generations), 1) for i, b in work]}


# --------------------------------------------------------------------------- the kit

class KitStopped(Exception):
    """The budget ran out while a child was running (it was stopped)."""


class Kit:
    """The kit's parent process: its plan, its children (each in its own session, stopped with it) and the JSON,
    written atomically after every phase, step and piece of work."""

    def __init__(self, args, out: Path, log=print):
        self.args, self.out, self.log = args, out, log
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.report: dict = {}
        self.proc: Optional[subprocess.Popen] = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def write(self) -> None:
        self.report["elapsed_s"] = self.elapsed()
        write_json(self.out, self.report)

    def child(self, function: str, job: dict, label: str, on_part=None,
              module: str = "bench.gpu_first_run") -> subprocess.CompletedProcess:
        """`module.function(job)` in a fresh process, its output shown as it comes, with a timeout from what is left of
        the budget; the partial figures it writes to job['part'] go into the JSON as they come (`on_part`).
        Raises KitStopped when the budget ended it."""
        timeout = self.remaining() - RESERVE_S  # its timeout: the budget's end, less stopping it and the JSON
        ends = time.monotonic() + timeout
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the CPU twin reads glibc's heap
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env["LOWVRAM_KIT_PARENT"] = str(os.getpid())
        # its own session: the kit decides when it stops (a terminal's Ctrl-C or `timeout` reach the kit only)
        self.proc = proc = subprocess.Popen([sys.executable, "-c", CHILD.format(function, module), json.dumps(job)],
                                            cwd=REPO,
                                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            start_new_session=True)
        out, err = [], []

        def pump(stream, into, show):
            for line in stream:
                into.append(line)
                show(line.rstrip("\n"))

        threads = [threading.Thread(target=pump, args=(proc.stdout, out, self.log), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, err, lambda s: print(s, file=sys.stderr)),
                                    daemon=True)]
        for thread in threads:
            thread.start()
        part, seen = Path(job["part"]), None
        ended_by_budget = False
        try:
            while True:
                try:
                    code = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_part is not None and part.is_file() and part.stat().st_mtime_ns != seen:
                    seen = part.stat().st_mtime_ns
                    with contextlib.suppress(ValueError, OSError):
                        on_part(json.loads(part.read_text()))
                if time.monotonic() > ends:
                    self.log(f"kit: {label} reached its timeout of {timeout:.0f} s (the budget of "
                             f"{self.args.budget_s} s ends): stopping it")
                    ended_by_budget = True
                    code = self.stop_child()
                    break
        except BaseException:  # a signal to the kit (StopRequested), Ctrl-C: the child goes with it
            self.stop_child()
            if on_part is not None and part.is_file():
                with contextlib.suppress(ValueError, OSError):
                    on_part(json.loads(part.read_text()))
            raise
        finally:
            self.proc = None
        for thread in threads:
            thread.join(timeout=5)
        if on_part is not None and part.is_file():
            with contextlib.suppress(ValueError, OSError):
                on_part(json.loads(part.read_text()))
        if ended_by_budget:
            raise KitStopped(label)
        return subprocess.CompletedProcess(proc.args, code, "".join(out), "".join(err))

    def stop_child(self) -> Optional[int]:
        """SIGTERM to the running child's process group, SIGKILL after KILL_GRACE_S; its exit code."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else None
        import signal

        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                return proc.wait(timeout=wait)
        return proc.poll()


CHILD = ("import ctypes, os, signal, sys\n"
         "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kit gone, its child goes too\n"
         "if str(os.getppid()) != os.environ.get('LOWVRAM_KIT_PARENT', str(os.getppid())): sys.exit(1)\n"
         "import json; from {1} import {0}; sys.exit({0}(json.loads(sys.argv[1])))")


def _error_line(stderr: str) -> Optional[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    return lines[-1] if lines else None


def available_variants() -> list[str]:
    import importlib.util

    return [v for v in VARIANTS if importlib.util.find_spec(NEEDS[v]) is not None]


DATA = ["data.dataset=null", "data.eval_dataset=null"]  # built-in problems: nothing is downloaded


# The families whose stand-in the kit builds from the plan's shape alone (config.json's model_type): dense
# decoders whose config takes the shape's fields as they are. Gemma 3 (sliding layers, four norms), Qwen3.5
# (linear-attention layers) and gpt-oss (experts) need fields the shape does not carry: refused in settle.
STAND_IN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def settle(args):
    """(config, shape, variants) from the arguments, each refused with one line before anything is built or
    written: the preset with the kit's data settings, its model's shape, the variants in the order they run."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.core.errors import ConfigError
    from lowvram_grpo.settings.model_shapes import model_shape

    config = load_config(args.preset, DATA)
    shape = model_shape(config.model.name)  # a PlanError names the shapes it knows
    if shape.family not in STAND_IN_FAMILIES:
        raise ConfigError(f"--preset {args.preset}: the kit builds random stand-ins of the "
                          f"{', '.join(STAND_IN_FAMILIES)} families, not {shape.family} ({config.model.name}): "
                          f"try the preset itself on the card with python -m lowvram_grpo.run --preset "
                          f"{args.preset} --dry-run")
    installed = available_variants()
    variants = args.variants or installed
    for variant in variants:
        if variant not in VARIANTS:
            raise ConfigError(f"--variants: unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
        if variant not in installed:
            raise ConfigError(f"--variants: {variant} needs {NEEDS[variant]}, which is not installed here "
                              f"(installed variants: {', '.join(installed)})")
    return config, shape, [v for v in VARIANTS if v in variants]  # unsloth, hf-nf4, (cap, resume), hf-vllm


def prepare(args, tmp: Path, log=print, build=None, hardware=None) -> dict:
    """Everything before the first child: the preset with the kit's own data settings applied first (so a
    preset's hub dataset is never read), the model shape, the work in priority order sized to the budget, the
    stand-in checkpoint (`build(shape, folder, log)`, default build_checkpoint) and its tokenizer, the padded
    system prompt from the built-in problems, and each variant's settings, validated as the run validates them.
    `hardware`: this machine (default: read_hardware(), in a child process: the caller opens no CUDA context)."""
    from lowvram_grpo.settings.checks import before_load
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions

    config, shape, variants = settle(args)
    hardware = hardware or read_hardware()[0]
    cuda = hardware.cuda
    work = [("variant", v) for v in variants if v != "hf-vllm"]
    if "hf-nf4" in variants and not args.no_cap:
        work += [("cap", "hf-nf4"), ("resume", "hf-nf4")]
    work += [("variant", v) for v in variants if v == "hf-vllm"]
    costs = CostModel(cuda, shape.params)
    model_dir = Path(args.model_dir) if args.model_dir else tmp / "model"
    reused = (model_dir / "config.json").is_file()
    t = config.train
    budget_left = args.budget_s - (time.monotonic() - args.started) - costs.build(reused) - RESERVE_S
    pieces = [("variant" if kind == "variant" else kind, variant_overrides(v, cuda, config)[0] if kind == "variant"
               else "hf") for kind, v in work]
    size = sizing(pieces, costs, budget_left, args.steps, t.max_completion_length, config.eval.batch_size,
                  t.num_generations)
    builder = build or build_checkpoint
    model_dir = builder(shape, model_dir, log)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shortened = {}
    lengths = {"train.max_completion_length": size["tokens"], "train.max_prompt_length": t.max_prompt_length,
               "model.max_seq_length": config.model.max_seq_length, "eval.batch_size": size["eval_batch"],
               "data.eval_size": size["eval_batch"]}
    if size["tokens"] < t.max_completion_length:
        # prompts shorten by the same share, never below the longest unpadded prompt (nothing is cut off)
        _, natural = padded_system_prompt(config, tokenizer, pad=False)
        lengths["train.max_prompt_length"] = min(t.max_prompt_length, max(
            natural, t.max_prompt_length * size["tokens"] // t.max_completion_length))
        lengths["model.max_seq_length"] = min(config.model.max_seq_length, max(
            16, lengths["train.max_prompt_length"] + size["tokens"]))
    before = {"train.max_completion_length": t.max_completion_length, "train.max_prompt_length": t.max_prompt_length,
              "model.max_seq_length": config.model.max_seq_length, "eval.batch_size": config.eval.batch_size,
              "data.eval_size": config.eval.batch_size}
    for key, value in lengths.items():
        if value != before[key]:
            shortened[key] = {"from": before[key], "to": value}
    if size["steps"] < args.steps:
        shortened["--steps"] = {"from": args.steps, "to": size["steps"]}
    sized = load_config(args.preset, DATA + [f"{k}={v}" for k, v in lengths.items()])
    system, prompt_tokens = padded_system_prompt(sized, tokenizer)
    common = DATA + [f"{k}={v}" for k, v in lengths.items()] + [
        f"model.name={model_dir}", f"data.system_prompt={json.dumps(system)}", f"train.max_steps={size['steps']}",
        "train.save_steps=1", "train.logging_steps=1", "memory.host_allocator=system"]
    settings = {}
    for variant in variants:
        backend, extra = variant_overrides(variant, cuda, config)
        checked = load_config(args.preset, common + extra)  # the child's settings, checked here first
        before_load(checked)
        train_rows, eval_rows = load_questions(checked.data)
        settings[variant] = {"backend": backend, "overrides": common + extra, "train_questions": len(train_rows),
                             "eval_questions": len(eval_rows)}
        if shortened:  # the plan at the kit's lengths (what the child plans and measures) beside the preset's
            settings[variant]["plan_total_gib"] = {
                "preset_lengths": plan_total(load_config(args.preset, DATA + extra), backend, hardware),
                "kit_lengths": plan_total(checked, backend, hardware)}
    return {"config": config, "shape": shape, "cuda": cuda, "variants": variants, "work": work, "costs": costs,
            "sizing": size, "shortened": shortened, "model_dir": model_dir, "prompt_tokens": prompt_tokens,
            "common": common, "settings": settings, "steps": size["steps"]}


def plan_total(config, backend: str, hardware) -> Optional[float]:
    """memory.plan's total (GiB) for `config` on `hardware` (this machine, read_hardware(); a GPU preset on a CPU:
    any NVIDIA GPU, as the doctor plans it there), or None where no plan can be made."""
    from lowvram_grpo.core.errors import LowvramError
    from lowvram_grpo.settings.hardware import ANY_GPU
    from lowvram_grpo.settings.memory_plan import plan
    from lowvram_grpo.settings.resolve import resolve

    try:
        resolved = resolve(config, hardware if hardware.cuda or not config.requires_cuda else ANY_GPU, backend)
        return round(plan(config, resolved).total_gb, 3)
    except LowvramError:
        return None


def run_kit(args, log=print) -> dict:
    from lowvram_grpo.core import stops

    out = Path(args.out or REPO / "bench" / "results" / f"gpu_first_run-{Path(args.preset).stem}.json")
    _check_writable("--out", out, file=True)
    if args.model_dir:
        _check_writable("--model-dir", Path(args.model_dir), file=False)
    config, shape, variants = settle(args)  # bad input: one line, and no JSON written
    kit = Kit(args, out, log)
    args.started = kit.started
    hardware, versions = read_hardware()  # in a child: this process opens no CUDA context (FACTS_CHILD)
    cuda = hardware.cuda
    kit.report = report = {
        "kit": "python -m bench.gpu_first_run " + " ".join(args.argv), "preset": args.preset,
        "machine": {"cuda": cuda, **versions, "device": hardware.gpu_name if cuda else "cpu",
                    "facts": "hardware.detect() in a child process: the kit's parent opens no CUDA context"},
        "budget": {"budget_s": args.budget_s}, "done": [], "variants": {}, "cap": None, "resume": None}
    out.parent.mkdir(parents=True, exist_ok=True)
    kit.write()
    reused = bool(args.model_dir) and (Path(args.model_dir) / "config.json").is_file()
    need = preparation_s(config, shape, variants, cuda, reused)
    report["budget"]["preparation_s"] = need
    if kit.remaining() < need["min_budget_s"] - need["start_s"]:  # its start is behind it
        why = (f"skipped: the stand-in {shape.name} checkpoint (~{need['build_s']:.0f} s) and the first piece of work "
               f"({need['first_piece']}, ~{need['first_piece_s']:.0f} s at the shortest lengths) need ~"
               f"{need['min_budget_s'] - need['start_s']:.0f} s by the kit's estimate, {kit.remaining():.0f} s of the "
               f"budget left: nothing was built")
        log(f"kit: {why}")
        report["variants"] = {v: {"skipped": why} for v in variants}
        if "hf-nf4" in variants and not args.no_cap:
            report["cap"], report["resume"] = {"skipped": why}, {"skipped": why}
        _finish(kit, log)
        return report
    with tempfile.TemporaryDirectory(prefix="gpu-first-run-") as tmp:
        tmp = Path(tmp)
        try:
            prep = prepare(args, tmp, log, hardware=hardware)
            shape, costs = prep["shape"], prep["costs"]
            report["model"] = {"shape": shape.name, "params": shape.params, "vocab": shape.vocab,
                               "weight_seed": WEIGHT_SEED, "train_seed": prep["config"].train.seed,
                               "prompt_tokens_max": prep["prompt_tokens"]}
            report["steps"] = prep["steps"]
            report["shortened"] = prep["shortened"]
            report["plan_total_gib"] = {v: c["plan_total_gib"] for v, c in prep["settings"].items()
                                        if "plan_total_gib" in c}
            report["budget"].update(
                {"planned": [f"{kind} {v}" if kind == "variant" else kind for kind, v in prep["work"]],
                 "estimates_s": prep["sizing"]["estimates"], "fits_planned": prep["sizing"]["fits"],
                 "prepared_at_s": kit.elapsed(),
                 "cost_model": "COSTS in bench/gpu_first_run.py, " + ("CUDA: the H100's 2026-11-26 figures"
                                                                      if cuda else "CPU: builtin:tiny measured here")})
            report["done"].append("prepare")
            kit.write()
            for kind, variant in prep["work"]:
                if kind == "variant":
                    run_variant(kit, prep, variant, tmp)
                elif kind == "cap":
                    cap_and_resume(kit, prep, tmp)
            report["complete"] = True
        except KitStopped as exc:
            report["stopped"] = "budget"
            log(f"kit: the budget of {args.budget_s} s ended during {exc}; the JSON holds what finished")
        except stops.StopRequested as exc:
            report["stopped"] = stops.name(exc.signum)
            kit.stop_child()
            _finish(kit, log)
            raise stops.StopRequested(exc.signum, f"stopped by {stops.name(exc.signum)}: {out} holds what finished "
                                                  f"({', '.join(report['done']) or 'nothing'})") from None
    _finish(kit, log)
    return report


def _finish(kit: Kit, log) -> None:
    report = kit.report
    failed = [v for v, r in report["variants"].items() if "skipped" not in r and not r.get("finished")]
    checks = [report[p]["holds"] for p in ("cap", "resume") if report[p] and "holds" in report[p]]
    report["ok"] = bool(report["variants"]) and not failed and all(checks) and "stopped" not in report
    report["skipped"] = [name for name, r in [*report["variants"].items(), ("cap", report["cap"]),
                                              ("resume", report["resume"])] if r and "skipped" in r]
    print_table(report, log)
    kit.write()
    log(f"\nwrote {kit.out} ({kit.elapsed()} s of a {kit.args.budget_s} s budget)")


def _skip(kit: Kit, estimate: float, what: str) -> Optional[str]:
    """Why `what` does not start (its estimate is past what is left of the budget), or None."""
    left = kit.remaining() - RESERVE_S
    if estimate > left:
        return f"skipped: {what} needs ~{estimate:.0f} s by the kit's estimate, {max(left, 0):.0f} s of the budget left"
    return None


def run_variant(kit: Kit, prep: dict, variant: str, tmp: Path) -> None:
    report, costs = kit.report, prep["costs"]
    chosen = prep["settings"][variant]
    estimate = costs.estimate("variant", chosen["backend"], prep["steps"], prep["sizing"]["tokens"],
                              prep["sizing"]["eval_batch"], prep["config"].train.num_generations)
    why = _skip(kit, estimate, f"{variant} ({prep['steps']} steps)")
    if why:
        report["variants"][variant] = {"skipped": why, "estimated_s": round(estimate, 1)}
        kit.log(f"\n=== {variant}: {why} ===")
        kit.write()
        return
    job = {"variant": variant, "preset": kit.args.preset, "backend": chosen["backend"],
           "overrides": chosen["overrides"],
           "run_dir": str(tmp / f"run-{variant}"), "part": str(tmp / f"{variant}.json")}
    kit.log(f"\n=== {variant}: {chosen['backend']} backend, {prep['steps']} GRPO steps (~{estimate:.0f} s by the "
            f"kit's estimate, {kit.remaining():.0f} s of the budget left) ===")
    started = time.monotonic()

    def partial(part: dict) -> None:
        report["variants"][variant] = {**part, "estimated_s": round(estimate, 1),
                                       "wall_s": round(time.monotonic() - started, 1)}
        kit.write()

    try:
        proc = kit.child("measure", job, variant, on_part=partial)
    except BaseException as exc:  # the budget's end, a signal: what it measured so far stays, marked
        from lowvram_grpo.core import stops

        row = report["variants"].setdefault(variant, {"finished": False})
        row["stopped"] = "budget" if isinstance(exc, KitStopped) else (
            stops.name(exc.signum) if isinstance(exc, stops.StopRequested) else type(exc).__name__)
        raise
    took = time.monotonic() - started
    costs.learn(estimate, took)
    row = report["variants"].get(variant, {})
    if proc.returncode == 0 and row.get("finished"):
        report["done"].append(variant)
    else:
        row.update(finished=False, exit_code=proc.returncode,
                   error=_error_line(proc.stderr) or (proc.stderr.strip().splitlines() or [""])[-1])
    row.update(estimated_s=round(estimate, 1), wall_s=round(took, 1))
    report["variants"][variant] = row
    kit.write()


def _check_writable(option: str, path: Path, file: bool) -> None:
    """Refuse, before anything is built, a path the kit could not write."""
    from lowvram_grpo.core.errors import ConfigError

    if file and path.is_dir():
        raise ConfigError(f"{option} {path} is a directory: name a .json file")
    if not file and path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file: name a folder (made if missing)")
    existing = path.parent if file else path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: {existing} is not a writable folder")


def print_table(report: dict, log=print) -> None:
    """Measured peaks beside the plan's total, per variant (GiB), and the first step apart from the steady ones."""
    log("\n| variant | peak allocated | peak reserved | device used (peak) | plan total | step 1 s | steady step s |")
    log("|---|---|---|---|---|---|---|")
    for variant, r in report["variants"].items():
        if "peak_gib" not in r:
            log(f"| {variant} | {r.get('skipped') or 'not finished: ' + str(r.get('error') or r.get('stopped'))} "
                f"| | | | {r.get('first_step_s', '')} | {r.get('steady_step_s_mean', '')} |")
            continue
        peak = r["peak_gib"]
        log(f"| {variant} | {peak['peak_allocated']:.3f} | {peak['peak_reserved']:.3f} | {peak['used_peak']:.3f} | "
            f"{r['plan'].get('total_gib', '-')} | {r['first_step_s']} | {r['steady_step_s_mean']} |")
    for part in ("cap", "resume"):
        if report[part]:
            if "skipped" in report[part]:
                log(f"{part}: {report[part]['skipped']}")
            elif "holds" in report[part]:
                log(f"{part}: {'holds' if report[part]['holds'] else 'DOES NOT HOLD'}"
                    + (f" ({report[part].get('error_line')})" if part == "cap" else ""))
    for key, change in report.get("shortened", {}).items():
        log(f"shortened to fit the budget: {key} {change['from']} -> {change['to']}")
    if report.get("stopped"):
        log(f"stopped: {report['stopped']}")


def cap_and_resume(kit: Kit, prep: dict, tmp: Path) -> None:
    """The hf-nf4 run capped after its first checkpoint: the package's out-of-memory line and the checkpoint;
    then `--resume` without the cap finishes it."""
    from lowvram_grpo.report.run_dir import RunDir

    report, costs, steps = kit.report, prep["costs"], prep["steps"]
    measured = report["variants"].get("hf-nf4", {})
    if "step_adds_gib" not in measured:
        why = measured.get("skipped") and "skipped: hf-nf4 was skipped" or "skipped: hf-nf4 did not finish"
        report["cap"], report["resume"] = {"skipped": why}, {"skipped": why}
        kit.write()
        return
    size = prep["sizing"]
    cap_s = costs.estimate("cap", "hf", steps, size["tokens"], size["eval_batch"], prep["config"].train.num_generations)
    resume_s = costs.estimate("resume", "hf", steps, size["tokens"], size["eval_batch"],
                              prep["config"].train.num_generations)
    why = _skip(kit, cap_s + resume_s, "the cap and its --resume")  # one without the other proves nothing
    if why:
        report["cap"], report["resume"] = {"skipped": why, "estimated_s": round(cap_s, 1)}, {
            "skipped": why, "estimated_s": round(resume_s, 1)}
        kit.log(f"\n=== the cap: {why} ===")
        kit.write()
        return
    run = tmp / "run-capped"
    argv = ["--preset", kit.args.preset, "--backend", "hf", "--output-dir", str(run)]
    for value in prep["settings"]["hf-nf4"]["overrides"] + ["eval.enabled=false"]:
        argv += ["--set", value]
    job = {"argv": argv, "run_dir": str(run), "part": str(tmp / "cap.json"),
           "step_adds": int(measured["step_adds_gib"] * GIB)}
    kit.log(f"\n=== the cap: hf-nf4 again, capped after its first checkpoint (~{cap_s:.0f} s) ===")
    started = time.monotonic()
    try:
        proc = kit.child("capped", job, "the cap")
    except KitStopped:
        report["cap"] = {"stopped": "budget"}
        raise
    costs.learn(cap_s, time.monotonic() - started)
    info = json.loads(Path(job["part"]).read_text()) if Path(job["part"]).is_file() else {}
    line = _error_line(proc.stderr)
    checkpoint = RunDir(run).latest_checkpoint()
    plan_total = measured["plan"].get("total_gib")
    cap = {"variant": "hf-nf4", "exit_code": proc.returncode, "error_line": line,
           "step_adds_gib": measured["step_adds_gib"],
           "cap_share": CAP_SHARE, "plan_total_gib": plan_total, **info,
           "checkpoint_kept": checkpoint.name if checkpoint else None, "estimated_s": round(cap_s, 1),
           "wall_s": round(time.monotonic() - started, 1)}
    cap["holds"] = bool(proc.returncode == 1 and line and line.startswith("error: CUDA out of memory ")
                        and checkpoint is not None and f"the last checkpoint is kept in {checkpoint}" in line)
    if plan_total and "cap_gib" in info:
        cap["cap_below_plan"] = info["cap_gib"] < plan_total
    report["cap"] = cap
    report["done"].append("cap")
    kit.write()
    kit.log(f"\n=== resume: python -m lowvram_grpo.run --resume {run} (no cap, ~{resume_s:.0f} s) ===")
    started = time.monotonic()
    try:
        resumed = kit.child("resume", {"run_dir": str(run), "part": str(tmp / "resume.json")}, "the resume")
    except KitStopped:
        report["resume"] = {"stopped": "budget"}
        raise
    costs.learn(resume_s, time.monotonic() - started)
    summary = RunDir(run).read_summary() or {}
    result = {"command": f"python -m lowvram_grpo.run --resume {run}", "exit_code": resumed.returncode,
              "resumed_from": checkpoint.name if checkpoint else None, "status": summary.get("status"),
              "steps": summary.get("steps"), "error_line": _error_line(resumed.stderr),
              "estimated_s": round(resume_s, 1), "wall_s": round(time.monotonic() - started, 1)}
    result["holds"] = bool(resumed.returncode == 0 and checkpoint is not None and f"resuming from {checkpoint}" in
                           resumed.stdout and summary.get("status") == "complete" and summary.get("steps") == steps)
    report["resume"] = result
    report["done"].append("resume")
    kit.write()


_steps = whole_number_at_least(2, " (the cap needs a checkpoint before the step it caps)")
_budget = whole_number_at_least(1, " (seconds the kit may take, all its work included)")
DEFAULT_BUDGET_S = 480  # one command on a lent card may run 10 minutes: the kit's share, the machine's start and
                        # margin left


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one variant")
    return names


def build_parser() -> argparse.ArgumentParser:
    from lowvram_grpo.core.commands import ArgumentParser

    p = ArgumentParser(prog="python -m bench.gpu_first_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="the preset whose model shape and settings are measured")
    p.add_argument("--variants", type=_variants, help=f"comma-separated, from {', '.join(VARIANTS)} (default: every "
                   "one whose package is installed; run in the order unsloth, hf-nf4, hf-vllm)")
    p.add_argument("--steps", type=_steps, default=3, help="GRPO steps per run (default 3; at least 2; fewer when the "
                   "budget needs it)")
    p.add_argument("--budget-s", type=_budget, default=DEFAULT_BUDGET_S, help="seconds the whole kit may take "
                   f"(default {DEFAULT_BUDGET_S}: one 10-minute command on a lent card, less its start and a margin); "
                   "it sizes steps and lengths to fit, skips what would not, and stops a child when the time is up")
    p.add_argument("--out", help="the JSON to write (default bench/results/gpu_first_run-PRESET.json); rewritten "
                   "after every phase and step")
    p.add_argument("--model-dir", help="build (or reuse) the stand-in checkpoint here instead of a temporary folder")
    p.add_argument("--no-cap", action="store_true", help="skip the capped run and its resume")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv=None) -> int:
    from lowvram_grpo.core.commands import guarded
    from lowvram_grpo.core.errors import TrainingStopped

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv

    def body() -> int:
        report = run_kit(args)
        if not report["ok"] and not report.get("stopped"):
            failed = [f"{v}: {r.get('error')}" for v, r in report["variants"].items()
                      if "skipped" not in r and not r.get("finished")]
            if report["cap"] and report["cap"].get("holds") is False:
                failed.append(f"the capped run did not end with the out-of-memory line and a checkpoint "
                              f"(exit {report['cap']['exit_code']}: {report['cap']['error_line']})")
            if report["resume"] and report["resume"].get("holds") is False:
                failed.append(f"--resume did not finish the capped run (exit {report['resume']['exit_code']}: "
                              f"{report['resume']['error_line']})")
            if not report["variants"]:
                failed.append("no variant ran")
            raise TrainingStopped("the kit's checks failed: " + "; ".join(map(str, failed)))
        return 0

    return guarded(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
