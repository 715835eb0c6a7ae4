"""unsloth_zoo's own sizing of a run, re-done in pure Python: what the unsloth backend really gets.

unsloth / unsloth_zoo refuse to import without a GPU, so the plan and the doctor cannot ask them; these
functions repeat their arithmetic step for step (the pinned 2026.10.9 source; tests/test_gpu_wheels.py runs
unsloth_zoo's own functions, extracted from the installed source, against these):

- vLLM's share (`unsloth_zoo.vllm_utils.approximate_vllm_memory_usage`, called by `load_vllm` for
  `fast_inference=True`): vLLM is given gpu_memory_utilization x the memory *free when it loads*, not x
  the card's total (less, where that would leave the training side under unsloth's activation estimate);
  the utilization vLLM is started with is that share / the total, so vLLM's own start-up check (that much
  free) always passes.
- vLLM's max_model_len: unsloth estimates the KV cache left in that share (its own estimate of the
  weights, a LoRA slot, CUDA graphs), counts the tokens it holds in 256s, and starts vLLM with
  min(max_seq_length, those tokens) (`_fit_max_seq_length_to_kv_cache`, 256 when it holds none). A
  rollout longer than that is cut; a longer prompt is refused by vLLM.
- the log-prob chunks of unsloth's GRPO trainer (`unsloth_zoo.fused_losses.fused_linear.fused_linear_rows`):
  rows per chunk of the fused LM head, instead of TRL's [4096 x 32768] tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2 ** 30
# unsloth_zoo.vllm_utils: its NF4 factor (16/5: 4-bit "should be 4.5 but use 5"), 2-byte LoRA and KV cache
UNSLOTH_4BIT_FACTOR = 16 / 5
KV_TOKEN_ROUNDING = 256
# approximate_vllm_memory_usage's bytes per KV element: "float16 is 2 bytes. float8 is 1.25 bytes" (its estimate of fp8
# with scales and slack; vLLM's fp8 cache itself stores 1 byte an element, what the plan's KV term counts)
KV_ELEMENT_BYTES, FP8_KV_ELEMENT_BYTES = 2, 1.25
CUDA_GRAPHS, CUDA_GRAPH_MIN, CUDA_GRAPH_MAX = 172, int(0.15 * 1024 ** 3), int(1.0 * 1024 ** 3)


@dataclass(frozen=True)
class VllmBudget:
    """What unsloth_zoo's load_vllm starts vLLM with."""
    share_bytes: float          # actual_gpu_memory_utilization x total: vLLM's share of the card
    utilization: float          # actual_gpu_memory_utilization, what vLLM is given
    kv_cache_bytes: float       # unsloth's estimate of the KV cache in the share (memory_left_for_kv_cache)
    kv_tokens: int              # the tokens that estimate holds, in 256s (max_num_batched_tokens)
    max_model_len: int          # vLLM's max_model_len: min(max_seq_length, kv_tokens), 256 when kv_tokens is 0


def _lora_elements(shape, max_lora_rank: int) -> int:
    """2-byte LoRA slot elements of every q/k/v/o/gate/up/down layer (vLLM's max_loras=1), x 2 as unsloth counts."""
    hd, mlp, r = shape.hidden, shape.intermediate, max_lora_rank
    q_size, kv_size = shape.dim_per_head * shape.heads, shape.dim_per_head * shape.kv_heads
    qkvo_a, qkvo_b = r * (hd * 3 + q_size), r * (q_size + kv_size + kv_size + hd)
    mlp_a, mlp_b = hd * r * 2 + mlp * r, r * (mlp + mlp) + r * hd
    return (qkvo_a + qkvo_b + mlp_a + mlp_b) * 1 * shape.layers * 2


def unsloth_weight_bytes(shape, load_in_4bit: bool) -> float:
    """unsloth_zoo's vllm_weights_memory_usage: linear weights at 2 / (16/5) bytes in 4-bit (2 in 16-bit), every
    other parameter (embeddings, lm_head, norms) at 2 bytes. (Qwen2's q/k/v biases, 2 bytes each, are left out.)"""
    quantized = 2 / UNSLOTH_4BIT_FACTOR if load_in_4bit else 2
    return shape.linear_params * quantized + shape.other_params * 2


def max_activation_bytes(shape, max_seq_length: int) -> float:
    """unsloth's reserve for the training side's activations (bsz 2, 16-bit, + 25%)."""
    hd, mlp, bsz = shape.hidden, shape.intermediate, 2
    kv_size_hidden = hd // shape.heads * shape.kv_heads
    activation_qkv = max_seq_length * bsz * (hd + kv_size_hidden + kv_size_hidden)
    residual = (max_seq_length * bsz) * 2
    activation_mlp = max_seq_length * bsz * (mlp + mlp)
    return ((activation_qkv + residual + activation_mlp + mlp * hd) * 1.25) * 2


def vllm_budget(shape, gpu_memory_utilization: float, free_bytes: float, total_bytes: float, max_seq_length: int,
                max_lora_rank: int, load_in_4bit: bool, float8_kv_cache: bool = False) -> VllmBudget:
    """approximate_vllm_memory_usage + _fit_max_seq_length_to_kv_cache for a dense text model (full, sliding-window
    or linear-attention layers: Llama, Qwen2/3, Qwen3.5, Gemma 3), fast_inference with LoRA, training=True, as unsloth's
    from_pretrained calls it with our settings (model.max_seq_length, the vLLM-rounded lora rank,
    memory.gpu_memory_utilization, float8_kv_cache: the resolved model.kv_cache_dtype is fp8)."""
    free = gpu_memory_utilization * free_bytes
    maximum_activation = max_activation_bytes(shape, max_seq_length)
    if total_bytes - free < maximum_activation:
        free = total_bytes - maximum_activation
    utilization = free / total_bytes
    lora = _lora_elements(shape, max_lora_rank)
    left = free - (unsloth_weight_bytes(shape, load_in_4bit) + lora)
    left -= min(max(CUDA_GRAPHS * (shape.hidden * shape.layers * 4), CUDA_GRAPH_MIN), CUDA_GRAPH_MAX)
    left = max(left, 0)
    element_bytes = FP8_KV_ELEMENT_BYTES if float8_kv_cache else KV_ELEMENT_BYTES
    # unsloth_zoo's _kv_cache_elements_per_token: the attention layers only (linear-attention ones hold a fixed state),
    # sliding-window layers apart (real head_dim); a full-attention model gives int(0.95 x left / bytes per token)
    full, sliding = shape.kv_elements_per_token()
    tokens = kv_cache_tokens(0.95 * left, full * element_bytes, [(w, e * element_bytes) for w, e in sliding],
                             shape.context or 0) if left > 0 else 0
    tokens = (tokens // KV_TOKEN_ROUNDING) * KV_TOKEN_ROUNDING
    if tokens <= 0:
        length = 256
    else:
        length = min(max_seq_length, tokens)
    return VllmBudget(free, utilization, left, tokens, length)


def kv_cache_tokens(memory_bytes: float, full_bytes: float, sliding_bytes: list, context_length: int,
                    in_flight_tokens: int = 2 * 8192) -> int:
    """unsloth_zoo's _kv_cache_tokens: the longest single sequence a KV cache of `memory_bytes` holds, where
    full-attention layers take `full_bytes` a token and each (window, bytes a token) sliding group keeps at most
    window + in-flight tokens (vLLM's SlidingWindowSpec)."""
    if memory_bytes <= 0:
        return 0
    caps = sorted((window + in_flight_tokens, b) for window, b in sliding_bytes)
    growing = full_bytes + sum(b for _, b in caps)
    used, start = 0, 0
    for cap, b in caps:
        if growing <= 0:
            break
        if used + (cap - start) * growing >= memory_bytes:
            break
        used += (cap - start) * growing
        start, growing = cap, growing - b
    if growing <= 0:
        return max(context_length, start)
    return int(start + (memory_bytes - used) / growing)


# --------------------------------------------------------------------------- unsloth's GRPO log-prob chunks

FUSED_CHUNK_BYTES = 2 * GIB       # _CHUNK_GB (UNSLOTH_LOGPROB_CHUNK_GB): a chunk's logits at most, or half the free
                                  # memory
FUSED_MIN_LOGITS = 512 * 151936   # _MIN_LOGITS: fewer rows starve the K = vocab GEMM
FUSED_MAX_ROWS = 4096             # _MAX_ROWS (UNSLOTH_FUSED_LINEAR_MAX_ROWS)
FUSED_BYTES_PER_LOGIT = 4         # fp32 logits


def _pow2(x: float) -> int:
    return 1 << max(int(math.ceil(math.log2(max(x, 1)))), 0)


def fused_linear_rows(n_rows: int, hidden: int, vocab: int, budget_bytes: int = FUSED_CHUNK_BYTES,
                      bytes_per_logit: int = FUSED_BYTES_PER_LOGIT) -> int:
    """unsloth_zoo's fused_linear_rows: rows per chunk, a power of two at or below n_rows x hidden / vocab,
    at least ~512 x 151936 logits' worth (<= 4096 rows), within the chunk budget (min(2 GiB, free / 2))."""
    rows = _pow2(n_rows * hidden / max(vocab, 1))
    if rows > n_rows * hidden / max(vocab, 1):
        rows //= 2
    min_rows = _pow2(FUSED_MIN_LOGITS / max(vocab, 1))
    if min_rows > FUSED_MIN_LOGITS / max(vocab, 1):
        min_rows //= 2
    min_rows = min(max(min_rows, 512), FUSED_MAX_ROWS)
    rows = min(max(rows, min_rows), FUSED_MAX_ROWS)
    cap = budget_bytes // max(vocab * bytes_per_logit, 1)
    rows = min(rows, max(cap, 2))
    return max(min(rows, max(n_rows, 1)), 1)
