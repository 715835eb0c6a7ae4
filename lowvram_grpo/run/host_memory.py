"""Host (CPU RAM) memory: keep the process's resident memory flat over a run.

Two causes of a CPU run's peak RSS, and what this module does about each (measured per variant by
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
   almost nothing is alive: each priming step, each GRPO step (`ReleaseHostMemory` callback) and each held-out
   batch. Within a step glibc's heap still spreads; the cure for that is the allocator itself: a CPU run starts
   on mimalloc (allocator.py, `memory.host_allocator`).

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
