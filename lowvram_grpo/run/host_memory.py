"""Host (CPU RAM) memory: keep the process's resident memory flat over a run.

Two measured causes of the default CPU job's 3-4 GB peak RSS (SmolLM2-135M, `bench/host_memory.py`):

1. **A 432 MB copy in every generation prefill.** transformers' causal-LM head gets the last position
   as a strided view, `hidden[:, -1:, :]` ([batch, 1, hidden], not contiguous). On CPU, `F.linear` on a
   non-contiguous 3-D bf16 input cannot fold the batch into one matrix product: it goes through
   `matmul`/`bmm` with the weight expanded to [batch, hidden, vocab] and made contiguous — 8 x 576 x
   49152 bf16 = 432 MB allocated and copied once per `generate` call (each GRPO step, each held-out
   batch; seen in torch.profiler as one `aten::contiguous` on [8, 576, 49152]). `contiguous_head_input`
   registers a forward pre-hook on the output embeddings that makes that [batch, 1, hidden] input
   contiguous (a 9 KB copy): the same samples (tested), no 432 MB transient, no large copy.

2. **glibc heap fragmentation.** Freed tensors stay in glibc's heap: the KV cache grows by `torch.cat`
   every decoded token (each new block slightly larger than the freed one; 1.25 GB of `aten::cat`
   allocations in one 8 x 64-token generate), training shapes change every step, and glibc's dynamic
   mmap threshold rises (up to 32 MB) to the size of each large block freed, so most tensors live in
   the heap. Measured with `mallinfo2` on a shortened default job: ~300-450 MB in use, 1.1-1.5 GB free
   inside the heap, and the heap grows by ~25-40 MB per GRPO step. `release()` hands the allocator's
   free pages back to the kernel (glibc: `malloc_trim(0)`, every arena, `madvise(MADV_DONTNEED)`;
   mimalloc: `mi_collect(true)`; allocator.py) at the boundaries where almost nothing is alive: each
   priming step, each GRPO step (`ReleaseHostMemory` callback) and each held-out batch. The RSS between
   steps then stays ~1 GB instead of climbing. Within a step glibc's heap still spreads (3.5-4 GB peaks);
   the cure for that is the allocator itself: the CPU run starts on mimalloc (allocator.py,
   `memory.host_allocator`), which does not spread. Both are measured per variant in bench/host_memory.py.

No-ops where they do not apply: `release()` on another allocator (macOS, musl) returns False; the hook only
acts on non-contiguous 3-D CPU inputs. `LOWVRAM_GRPO_HOST_MEMORY` turns them off for comparison: a
comma list of what stays on (`trim`, `head`; default both), `off` or empty for neither.
"""
from __future__ import annotations

import os

from transformers import TrainerCallback

from lowvram_grpo.model import internals
from lowvram_grpo.run import allocator

FEATURES = ("trim", "head")


def enabled(feature: str) -> bool:
    """Whether `feature` (trim | head) is on: LOWVRAM_GRPO_HOST_MEMORY lists those on (default: all)."""
    value = os.environ.get("LOWVRAM_GRPO_HOST_MEMORY")
    if value is None:
        return True
    return feature in {part.strip() for part in value.split(",")}


def release() -> bool:
    """Return the allocator's free pages to the OS (allocator.release). True when the call was made."""
    if not enabled("trim"):
        return False
    return allocator.release()


class ReleaseHostMemory(TrainerCallback):
    """`release()` after every optimizer step."""
    def on_step_end(self, args, state, control, **kwargs):
        release()


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
