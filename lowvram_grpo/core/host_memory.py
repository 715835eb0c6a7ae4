"""Host (CPU RAM) memory: keep the process's resident memory flat over a run.

Three causes of a CPU run's peak RSS, and what this module does about each (measured per variant by
`bench/host_memory.py`; the figures: docs/results.md, "Host memory over the default job"):

1. **A [batch, hidden, vocab] copy in every generation prefill.** transformers' causal-LM head gets the last
   position as a strided view, `hidden[:, -1:, :]` ([batch, 1, hidden], not contiguous). On CPU, `F.linear` on a
   non-contiguous 3-D input cannot fold the batch into one matrix product: it goes through `matmul`/`bmm` with
   the weight expanded to [batch, hidden, vocab] and made contiguous, once per `generate` call.
   `contiguous_head_input` registers a forward pre-hook on the output embeddings that makes that
   [batch, 1, hidden] input contiguous (a [batch, hidden] copy): the same samples (tested), no large transient.

2. **Heap fragmentation.** Freed tensors stay in glibc's heap: the KV cache grows by `torch.cat` every decoded
   token, training shapes change every step, and glibc's dynamic mmap threshold rises to the size of each large
   block freed, so most tensors live in the heap. `release()` hands the allocator's free pages back to the kernel
   (glibc: `malloc_trim(0)`, every arena; mimalloc: `mi_collect(true)`; allocator.py) at the boundaries where
   almost nothing is alive: each priming step, each GRPO step (training.grpo's `ReleaseHostMemory` callback) and each
   held-out batch. Within a step glibc's heap still spreads; the cure for that is the allocator itself: a CPU run starts
   on mimalloc (allocator.py, `memory.host_allocator`).

3. **Compiled kernels kept for every shape.** bf16 matmuls on a CPU run through oneDNN, which caches one
   primitive per problem shape, and PyTorch's ideep layer over it keeps its own per-shape cache; 1024 entries each
   by default. Every GRPO step brings new prompt and completion lengths, so these caches, not the allocator, made
   the RSS between steps creep (~+4.5 MB a step over the default job) and a step's peak with it.
   `limit_kernel_caches` caps both at KERNEL_CACHE_CAPACITY entries when the model loads
   (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, `LRU_CACHE_CAPACITY`): each is read once, when the first matmul builds its
   cache, so the cap holds in a process that has not run a bf16 matmul yet (the CLI's, a fresh kernel's); a
   value the user set is kept. Measured: docs/results.md, "Host memory" (peak RSS and step time).

No-ops where they do not apply: `release()` on another allocator (macOS, musl) returns False; the hook only
acts on non-contiguous 3-D CPU inputs; the cache cap on a float32 CPU (MKL, not oneDNN) or a GPU run.
`LOWVRAM_GRPO_HOST_MEMORY` turns them off for comparison: a comma list of what stays on (`trim`, `head`,
`kernel_cache`; default all), `off` or empty for none.
"""
from __future__ import annotations

import os

from lowvram_grpo.core import internals
from lowvram_grpo.core import allocator

FEATURES = ("trim", "head", "kernel_cache")
KERNEL_CACHE_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, PyTorch's ideep layer's
KERNEL_CACHE_CAPACITY = 8  # entries kept in each: shapes rebuilt when they come back, at no step time measured


def enabled(feature: str) -> bool:
    """Whether `feature` (trim | head | kernel_cache) is on: LOWVRAM_GRPO_HOST_MEMORY lists those on (default: all)."""
    value = os.environ.get("LOWVRAM_GRPO_HOST_MEMORY")
    if value is None:
        return True
    return feature in {part.strip() for part in value.split(",")}


def release() -> bool:
    """Return the allocator's free pages to the OS (allocator.release). True when the call was made."""
    if not enabled("trim"):
        return False
    return allocator.release()


def _contiguous_input(module, args):
    x = args[0] if args else None
    if x is not None and x.dim() == 3 and x.device.type == "cpu" and not x.is_contiguous():
        return (x.contiguous(),) + tuple(args[1:])
    return None


def contiguous_head_input(model) -> bool:
    """Make the output embeddings (LM head) take a contiguous input (fix 1 above). True when hooked."""
    if not enabled("head"):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or internals.mark(head, "contiguous_input", False):
        return False
    head.register_forward_pre_hook(_contiguous_input)
    internals.set_mark(head, "contiguous_input", True)
    return True


def limit_kernel_caches(environ=os.environ) -> list:
    """Cap the per-shape kernel caches (cause 3 above) whose size the user did not set: the variables set here."""
    if not enabled("kernel_cache"):
        return []
    names = [name for name in KERNEL_CACHE_ENVS if name not in environ]
    for name in names:
        environ[name] = str(KERNEL_CACHE_CAPACITY)
    return names
