"""Run the CLI in this process with a GPU-only failure injected where it happens on a GPU.

    python tests/inject_failures.py FAILURE CLI-ARGS...     (run from the repository root)

FAILURE is one of:
- `oom-training`:   torch.cuda.OutOfMemoryError raised by a decoder layer's (or the rotary module's) forward in a
                    training step (gradients on, inside Trainer.train, not generating), once a checkpoint exists;
- `oom-rollout`:    the same error while TRL generates the rollouts (inside Trainer.train, inside
                    `generate`), once a checkpoint exists;
- `oom-evaluation`: the same error while the trained adapter is measured (generating after training);
- `sigterm-in-vllm`: (model.generation=vllm) SIGTERM to the run's whole process group, as SLURM, systemd or
                    `kill -TERM -PGID` send it, from inside vLLM's `LLM.generate` while it answers the held-out
                    questions after training; vLLM's own processes get it too (only SIGINT/SIGHUP are blocked
                    there) and the call goes on into vLLM's frames once its EngineCore has ended.

The error is the one CUDA's caching allocator raises (its type and message), thrown from inside the
model's forward where an allocation fails on a card, so it travels through transformers, TRL,
accelerate and the pipeline exactly as a real one does. Nothing of the package is patched: only
torch's global module hook, `Trainer.train`, `GenerationMixin.generate` and our decode loop
(`decoding.decode`) are watched to know the phase (`sigterm-in-vllm`: `Trainer.train`, and vLLM's `LLM.generate`
where the signal is sent). The CLI's `main` (not `cli`, which may restart the process on another allocator) runs it.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import transformers
from transformers.generation.utils import GenerationMixin

# torch's own message on a card that ran out (c10/cuda/CUDACachingAllocator.cpp), as users see it
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which "
            "1.06 GiB is free. Of the allocated memory 12.31 GiB is allocated by PyTorch, and 0.94 GiB is reserved "
            "by PyTorch but unallocated.")
FAILURES = ("oom-training", "oom-rollout", "oom-evaluation", "sigterm-in-vllm")

state = {"training": False, "generating": False, "trained": False, "fired": False}


def _watch(cls, name: str, flag: str, after: str | None = None):
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        state[flag] = True
        try:
            return original(*args, **kwargs)
        finally:
            state[flag] = False
            if after:
                state[after] = True

    setattr(cls, name, wrapper)


def _has_checkpoint(output_dir: Path) -> bool:
    from lowvram_grpo.report.run_dir import RunDir

    return RunDir(output_dir).latest_checkpoint() is not None


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sigterm_in_vllm() -> None:
    """The first LLM.generate after training sends SIGTERM to the process group, waits (up to 60 s) for vLLM's
    EngineCore to end on it, then goes on into vLLM's own generate."""
    import os
    import signal
    import time

    import psutil
    import vllm

    original = vllm.LLM.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if state["trained"] and not state["fired"]:
            state["fired"] = True
            cores = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::EngineCore")]
            os.killpg(os.getpgrp(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while any(_alive(p) for p in cores) and time.monotonic() < deadline:
                time.sleep(0.1)
        return original(*args, **kwargs)

    vllm.LLM.generate = generate


def install(failure: str, output_dir: Path) -> None:
    _watch(transformers.Trainer, "train", "training", after="trained")
    if failure == "sigterm-in-vllm":
        _sigterm_in_vllm()
        return
    _watch(GenerationMixin, "generate", "generating")
    from lowvram_grpo.model import decoding

    _watch(decoding, "decode", "generating")  # our decode loop (decode.loop=lowvram) does not go through generate

    def due() -> bool:
        if failure == "oom-training":
            return (state["training"] and not state["generating"] and torch.is_grad_enabled()
                    and _has_checkpoint(output_dir))
        if failure == "oom-rollout":
            return state["training"] and state["generating"] and _has_checkpoint(output_dir)
        return state["trained"] and not state["training"] and state["generating"]

    def hook(module, args):
        # a decoder layer, or the rotary module: our fused layers (fused_decode.py) run no decoder-layer module
        if type(module).__name__.endswith(("DecoderLayer", "RotaryEmbedding")) and not state["fired"] and due():
            state["fired"] = True
            raise torch.cuda.OutOfMemoryError(CUDA_OOM)

    torch.nn.modules.module.register_module_forward_pre_hook(hook)


def main() -> int:
    failure, argv = sys.argv[1], sys.argv[2:]
    if failure not in FAILURES:
        raise SystemExit(f"unknown failure {failure!r}: one of {', '.join(FAILURES)}")
    install(failure, Path(argv[argv.index("--output-dir") + 1]))
    from lowvram_grpo.run.cli import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
