"""The first-run kit: what a CUDA card runs first, in minutes, with no model hub: the memory plan measured.

    python -m bench.gpu_first_run --preset llama8b_4bit                  # every variant installed here
    python -m bench.gpu_first_run --preset qwen1_5b_4bit --variants hf-nf4 --steps 2
    python -m bench.gpu_first_run --preset tiny                          # the same code on a CPU (the test suite)

1. A random-weight checkpoint of the preset's model shape (memory.model_shape, the table the plan uses;
   memory and speed do not depend on the values) with a stand-in tokenizer of the model's vocabulary size
   (the tiny model's BPE, filled up to that size), in a temporary folder (`--model-dir` keeps it for reuse).
   The system prompt is padded so the longest prompt is just under train.max_prompt_length, and random
   weights rarely sample the end token, so sequences reach the lengths the plan counts.
2. Each variant in a fresh process, loaded and trained as a run is (pipeline.GRPORun, the package's
   backends) with the preset's settings for `--steps` GRPO steps, a checkpoint each step, the held-out
   evaluation of the trained adapter (one batch of eval.batch_size questions): `hf-nf4` (hf backend, bitsandbytes NF4, transformers
   generation; always), `unsloth` (the preset's own unsloth settings, vLLM where installed) and `hf-vllm`
   (hf backend, model.generation=vllm) when installed. Per phase (load, rollout = generation inside
   training, training step = everything else in training, evaluation): peak allocated and reserved memory,
   the device's used memory (all processes: vLLM's engine too) at its peak and at the phase's end, the
   time; beside them the plan's terms (memory.plan), the step times, the dtype and optimizer really used,
   the checkpoint's size on disk against doctor's estimate.
3. The cap: `hf-nf4` again, through the CLI (lowvram_grpo.run.main), capped after its first checkpoint
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

from lowvram_grpo.commands import whole_number_at_least

REPO = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
VARIANTS = ("hf-nf4", "unsloth", "hf-vllm")
NEEDS = {"hf-nf4": "bitsandbytes", "unsloth": "unsloth", "hf-vllm": "vllm"}
CAP_SHARE = 0.25      # the cap: what the process holds between steps + this share of what a step adds on top
WEIGHT_SEED = 0
SHARD_BYTES = 2 * GIB  # the stand-in checkpoint's safetensors shards
RANDOM_BLOCK = 2 ** 24  # random values drawn for the stand-in checkpoint (copied into every matrix)
CHILD = "import json, sys; from bench.gpu_first_run import {0}; sys.exit({0}(json.loads(sys.argv[1])))"


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


class Phases:
    """Peak memory and time per phase. `switch(name)` closes the current phase and starts `name`; a poller
    samples the device's used memory (and the CPU twin's allocated bytes) every 10 ms for the peaks."""

    def __init__(self, memory):
        self.memory = memory
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
        if name == "rollout":  # a step starts with its rollout; what is held then stays through the step
            self.steps.append({"rollout_s": None, "training_s": None, "held_gib": round(self.memory.allocated() / GIB, 4),
                               "_start": now})
        self.memory.reset_peak()
        self.used_peak = self.memory.used()
        self.current, self.started = name, now

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

    def close(self) -> dict:
        self._stop.set()
        for step in self.steps:
            step.pop("_start", None)
        return {name: {**{k: round(v / GIB, 5) for k, v in row.items() if k not in ("seconds", "times")},
                       "seconds": round(row["seconds"], 2), "times": row["times"]} for name, row in self.results.items()}


# --------------------------------------------------------------------------- the stand-in checkpoint

def stand_in_tokenizer(vocab: int):
    """The tiny model's byte-level BPE (chat template, specials) with filler tokens up to `vocab` ids: text
    encodes as in builtin:tiny, every id a random model samples decodes (to '<id>'; the last to '<|endoftext|>')."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lowvram_grpo.builtin_models import ensure_tiny_model

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
    """A random bf16 checkpoint of `shape` (a memory.ModelShape) with the stand-in tokenizer, in `directory`;
    kept when one of this shape is there already. Written tensor by tensor in safetensors shards of at most
    SHARD_BYTES, so building Llama-3.1-8B's 16 GB needs ~2 GB of RAM (a Colab runtime has 12); on the CPU."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from lowvram_grpo.memory import model_shape

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
    if shape.head_dim:
        fields["head_dim"] = shape.head_dim
    config = (Qwen2Config if shape.name.lower().startswith("qwen") else LlamaConfig)(**fields)
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


def padded_system_prompt(config, tokenizer) -> tuple[str, int]:
    """The preset's system prompt with filler words, so the longest training prompt is just under
    train.max_prompt_length tokens (the length the plan counts); and that length."""
    from lowvram_grpo.data import load_questions, to_prompt_rows

    questions, _ = load_questions(config.data)
    sample = questions[:200]

    def longest(system: str) -> int:
        return max(len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
                   for row in to_prompt_rows(sample, system))

    limit, base = config.train.max_prompt_length, config.data.system_prompt
    now = longest(base)
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


def _summary_of_plan(resolved) -> dict:
    from lowvram_grpo.errors import PlanError
    from lowvram_grpo.memory import plan

    try:
        p = plan(resolved)
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
    return {"class": f"{type(inner).__module__}.{type(inner).__name__}", "optim_bits": getattr(args, "optim_bits", None),
            "is_paged": getattr(inner, "is_paged", None), "state_gib": round(state / GIB, 5)}


def peak_vs_plan(peak_gib: dict, plan_total_gib: float) -> dict:
    """Each measured peak (GiB) as a share of the plan's total, to 3 decimals: above 1, the plan fell short."""
    return {k: round(v / plan_total_gib, 3) for k, v in peak_gib.items()}


def measure(job: dict) -> int:
    """A child process: one variant's run, measured per phase; writes job['part']."""
    from lowvram_grpo.commands import guarded

    return guarded(lambda: _measure(job))


def _measure(job: dict) -> int:
    import torch

    from lowvram_grpo import allocator
    from lowvram_grpo.config import load_config
    from lowvram_grpo.doctor import checkpoint_bytes
    from lowvram_grpo.pipeline import GRPORun

    memory = device_memory()
    phases = Phases(memory)
    config = load_config(job["preset"], job["overrides"])
    grpo = GRPORun(config, job["run_dir"], backend=job["backend"])
    with phases.phase("load"):
        handle = grpo.load()
    from transformers.generation.utils import GenerationMixin

    phases.watch_generation(GenerationMixin)
    phases.watch_generation(handle.model)  # the instance's own: unsloth binds its generate onto the model
    if "vllm" in sys.modules:
        import vllm

        phases.watch_generation(vllm.LLM)
    grpo.start()  # the base model's evaluation is skipped: the trained adapter's (after) is the larger one
    with phases.phase("training"):
        grpo.train()
    adapter = grpo.save()
    with phases.phase("evaluation"):
        grpo.measure("after", adapter)
    grpo.finish()
    measured = phases.close()
    steps = [s for s in phases.steps if s["rollout_s"] is not None and s["training_s"] is not None]
    dtypes: dict[str, float] = {}
    for param in handle.model.parameters():
        name = str(param.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + param.numel() * param.element_size() / GIB
    trainable = sum(p.numel() * p.element_size() for p in handle.model.parameters() if p.requires_grad)
    checkpoint = grpo.run_dir.latest_checkpoint()
    resolved = grpo.resolved
    result = {
        "variant": job["variant"], "backend": resolved.backend, "overrides": job["overrides"],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "memory_source": memory.what, "host_allocator": allocator.active(),
        "resolved": {k: v for k, v in resolved.summary().items()},
        "plan": _summary_of_plan(resolved), "phases": measured, "steps": steps,
        "step_s_median": round(statistics.median(s["rollout_s"] + s["training_s"] for s in steps), 3) if steps else None,
        "dtype": {"resolved": resolved.dtype, "parameter_gib_by_dtype": {k: round(v, 5) for k, v in dtypes.items()},
                  "trainable_gib": round(trainable / GIB, 5)},
        "optimizer": optimizer_info(grpo.trainer.optimizer),
        "grpo_settings": grpo.trainer.effective_settings.get("settings", {}),
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) if checkpoint else None,
        "checkpoint_bytes_doctor_estimate": int(checkpoint_bytes(resolved) // (config.train.keep_checkpoints + 1)),
    }
    peak = {k: max(row[k] for row in measured.values()) for k in ("peak_allocated", "peak_reserved", "used_peak")}
    result["peak_gib"] = peak
    if steps:  # what a GRPO step adds on top of what is held between steps (the capped run's yardstick)
        step_peak = max(measured[p]["peak_allocated"] for p in ("rollout", "training") if p in measured)
        result["step_held_gib"] = statistics.median(s["held_gib"] for s in steps)
        result["step_adds_gib"] = round(max(step_peak - result["step_held_gib"], 0.0), 4)
    total = result["plan"].get("total_gib")
    if total:
        result["peak_vs_plan"] = peak_vs_plan(peak, total)
    Path(job["part"]).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def capped(job: dict) -> int:
    """A child process: the run through the CLI (lowvram_grpo.run.main), capped at the first rollout after its
    first checkpoint to what it holds then + CAP_SHARE x what the measured step added on top. Writes job['part']."""
    from transformers.generation.utils import GenerationMixin

    from lowvram_grpo.run import main as run_main
    from lowvram_grpo.run_dir import RunDir

    memory = device_memory()
    run_dir, info = RunDir(job["run_dir"]), {}
    generate = GenerationMixin.generate

    @functools.wraps(generate)
    def arm_then_generate(*args, **kwargs):
        checkpoint = None if info else run_dir.latest_checkpoint()
        if checkpoint is not None:
            held = memory.allocated()
            limit = int(held + CAP_SHARE * job["step_adds"])
            info.update(held_gib=round(held / GIB, 4), cap_gib=round(limit / GIB, 4), armed_after=checkpoint.name,
                        how=type(memory).__name__)
            memory.cap(limit)
        return generate(*args, **kwargs)

    GenerationMixin.generate = arm_then_generate
    code = run_main(job["argv"])
    Path(job["part"]).write_text(json.dumps({"exit_code": code, **info}, indent=2) + "\n")
    return code


# --------------------------------------------------------------------------- the kit

def _child(function: str, job: dict, log) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the CPU twin reads glibc's heap
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(function), json.dumps(job)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = [], []

    def pump(stream, into, show):
        for line in stream:
            into.append(line)
            show(line.rstrip("\n"))

    threads = [threading.Thread(target=pump, args=(proc.stdout, out, log)),
               threading.Thread(target=pump, args=(proc.stderr, err, lambda s: print(s, file=sys.stderr)))]
    for thread in threads:
        thread.start()
    code = proc.wait()
    for thread in threads:
        thread.join()
    return subprocess.CompletedProcess(proc.args, code, "".join(out), "".join(err))


def _error_line(stderr: str) -> Optional[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    return lines[-1] if lines else None


def available_variants() -> list[str]:
    import importlib.util

    return [v for v in VARIANTS if importlib.util.find_spec(NEEDS[v]) is not None]


def run_kit(args, log=print) -> dict:
    import torch

    from lowvram_grpo.config import load_config
    from lowvram_grpo.errors import ConfigError
    from lowvram_grpo.memory import model_shape

    config = load_config(args.preset)
    shape = model_shape(config.model.name)  # a PlanError names the shapes it knows
    installed = available_variants()
    variants = args.variants or installed
    for variant in variants:
        if variant not in VARIANTS:
            raise ConfigError(f"--variants: unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
        if variant not in installed:
            raise ConfigError(f"--variants: {variant} needs {NEEDS[variant]}, which is not installed here "
                              f"(installed variants: {', '.join(installed)})")
    out = Path(args.out or REPO / "bench" / "results" / f"gpu_first_run-{args.preset}.json")
    _check_writable("--out", out, file=True)
    if args.model_dir:
        _check_writable("--model-dir", Path(args.model_dir), file=False)
    cuda = torch.cuda.is_available()
    report = {"kit": "python -m bench.gpu_first_run " + " ".join(args.argv), "preset": args.preset,
              "machine": {"cuda": cuda, "torch": torch.__version__, "torch_cuda": torch.version.cuda},
              "model": {"shape": shape.name, "params": shape.params, "vocab": shape.vocab, "weight_seed": WEIGHT_SEED,
                        "train_seed": config.train.seed},
              "variants": {}, "cap": None, "resume": None}
    with tempfile.TemporaryDirectory(prefix="gpu-first-run-") as tmp:
        tmp = Path(tmp)
        model_dir = build_checkpoint(shape, Path(args.model_dir) if args.model_dir else tmp / "model", log)
        from transformers import AutoTokenizer

        system, prompt_tokens = padded_system_prompt(config, AutoTokenizer.from_pretrained(model_dir))
        report["model"]["prompt_tokens_max"] = prompt_tokens
        common = [f"model.name={model_dir}", "data.dataset=null", "data.eval_dataset=null",
                  f"data.eval_size={config.eval.batch_size}", f"data.system_prompt={json.dumps(system)}",
                  f"train.max_steps={args.steps}", "train.save_steps=1", "train.logging_steps=1",
                  "memory.host_allocator=system"]
        for variant in variants:
            backend, extra = variant_overrides(variant, cuda, config)
            job = {"variant": variant, "preset": args.preset, "backend": backend, "overrides": common + extra,
                   "run_dir": str(tmp / f"run-{variant}"), "part": str(tmp / f"{variant}.json")}
            log(f"\n=== {variant}: {backend} backend, {args.steps} GRPO steps ===")
            proc = _child("measure", job, log)
            if proc.returncode == 0:
                report["variants"][variant] = json.loads(Path(job["part"]).read_text())
            else:
                report["variants"][variant] = {"exit_code": proc.returncode, "error": _error_line(proc.stderr)
                                               or proc.stderr.strip().splitlines()[-1:]}
        first = report["variants"].get("hf-nf4", {})
        if not args.no_cap and "step_adds_gib" in first:
            report["cap"], report["resume"] = cap_and_resume(args, first, common, tmp, log)
    failed = [v for v, r in report["variants"].items() if "phases" not in r]
    report["ok"] = not failed and (args.no_cap or bool(report["cap"] and report["cap"]["holds"]
                                                     and report["resume"]["holds"]))
    print_table(report, log)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(staging, out)
    log(f"\nwrote {out}")
    return report


def _check_writable(option: str, path: Path, file: bool) -> None:
    """Refuse, before anything is built, a path the kit could not write."""
    from lowvram_grpo.errors import ConfigError

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
    """Measured peaks beside the plan's total, per variant (GiB)."""
    log("\n| variant | peak allocated | peak reserved | device used (peak) | plan total | step s (median) |")
    log("|---|---|---|---|---|---|")
    for variant, r in report["variants"].items():
        if "peak_gib" not in r:
            log(f"| {variant} | failed: {r.get('error')} | | | | |")
            continue
        peak = r["peak_gib"]
        log(f"| {variant} | {peak['peak_allocated']:.3f} | {peak['peak_reserved']:.3f} | {peak['used_peak']:.3f} | "
            f"{r['plan'].get('total_gib', '-')} | {r['step_s_median']} |")
    for part in ("cap", "resume"):
        if report[part]:
            log(f"{part}: {'holds' if report[part]['holds'] else 'DOES NOT HOLD'}"
                + (f" ({report[part].get('error_line')})" if part == "cap" else ""))


def cap_and_resume(args, measured: dict, common: list[str], tmp: Path, log) -> tuple[dict, dict]:
    """The hf-nf4 run capped after its first checkpoint: the package's out-of-memory line and the checkpoint;
    then `--resume` without the cap finishes it."""
    from lowvram_grpo.run_dir import RunDir

    run = tmp / "run-capped"
    backend, extra = variant_overrides("hf-nf4", measured["device"] != "cpu", None)
    argv = ["--preset", args.preset, "--backend", backend, "--output-dir", str(run)]
    for value in common + extra + ["eval.enabled=false"]:
        argv += ["--set", value]
    job = {"argv": argv, "run_dir": str(run), "part": str(tmp / "cap.json"), "step_adds": int(measured["step_adds_gib"] * GIB)}
    log(f"\n=== the cap: hf-nf4 again, capped after its first checkpoint ===")
    proc = _child("capped", job, log)
    info = json.loads(Path(job["part"]).read_text()) if Path(job["part"]).is_file() else {}
    line = _error_line(proc.stderr)
    checkpoint = RunDir(run).latest_checkpoint()
    plan_total = measured["plan"].get("total_gib")
    cap = {"variant": "hf-nf4", "exit_code": proc.returncode, "error_line": line, "step_adds_gib": measured["step_adds_gib"],
           "cap_share": CAP_SHARE, "plan_total_gib": plan_total, **info,
           "checkpoint_kept": checkpoint.name if checkpoint else None}
    cap["holds"] = bool(proc.returncode == 1 and line and line.startswith("error: CUDA out of memory ")
                        and checkpoint is not None and f"the last checkpoint is kept in {checkpoint}" in line)
    if plan_total and "cap_gib" in info:
        cap["cap_below_plan"] = info["cap_gib"] < plan_total
    log(f"\n=== resume: python -m lowvram_grpo.run --resume {run} (no cap) ===")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    resumed = subprocess.run([sys.executable, "-m", "lowvram_grpo.run", "--resume", str(run)], cwd=REPO, env=env,
                             capture_output=True, text=True)
    summary = RunDir(run).read_summary() or {}
    resume = {"command": f"python -m lowvram_grpo.run --resume {run}", "exit_code": resumed.returncode,
              "resumed_from": checkpoint.name if checkpoint else None, "status": summary.get("status"),
              "steps": summary.get("steps"), "error_line": _error_line(resumed.stderr)}
    resume["holds"] = bool(resumed.returncode == 0 and checkpoint is not None and f"resuming from {checkpoint}" in
                           resumed.stdout and summary.get("status") == "complete" and summary.get("steps") == args.steps)
    return cap, resume


_steps = whole_number_at_least(2, " (the cap needs a checkpoint before the step it caps)")


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one variant")
    return names


def build_parser() -> argparse.ArgumentParser:
    from lowvram_grpo.commands import ArgumentParser

    p = ArgumentParser(prog="python -m bench.gpu_first_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="the preset whose model shape and settings are measured")
    p.add_argument("--variants", type=_variants, help=f"comma-separated, from {', '.join(VARIANTS)} (default: every "
                   "one whose package is installed)")
    p.add_argument("--steps", type=_steps, default=3, help="GRPO steps per run (default 3; at least 2)")
    p.add_argument("--out", help="the JSON to write (default bench/results/gpu_first_run-PRESET.json)")
    p.add_argument("--model-dir", help="build (or reuse) the stand-in checkpoint here instead of a temporary folder")
    p.add_argument("--no-cap", action="store_true", help="skip the capped run and its resume")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv=None) -> int:
    from lowvram_grpo.commands import guarded
    from lowvram_grpo.errors import TrainingStopped

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv

    def body() -> int:
        report = run_kit(args)
        if not report["ok"]:
            failed = [f"{v}: {r.get('error')}" for v, r in report["variants"].items() if "phases" not in r]
            if report["cap"] and not report["cap"]["holds"]:
                failed.append(f"the capped run did not end with the out-of-memory line and a checkpoint "
                              f"(exit {report['cap']['exit_code']}: {report['cap']['error_line']})")
            if report["resume"] and not report["resume"]["holds"]:
                failed.append(f"--resume did not finish the capped run (exit {report['resume']['exit_code']}: "
                              f"{report['resume']['error_line']})")
            raise TrainingStopped("the kit's checks failed: " + "; ".join(map(str, failed)))
        return 0

    return guarded(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
