"""Per-token log-probs without Triton: the PyTorch twin of TRL's fused LM head kernel.

TRL 1.15's GRPOTrainer computes completion log-probs through a fused LM head whose kernel is Triton
(`trl.kernels.ChunkedLogProbFunction`). Triton needs a GPU driver: on a CPU it fails at the first
call when Triton is installed (unsloth requires it), and TRL has no kernel at all when it is not.
`trl_compat.install_logprob_fallback()` puts a dispatcher in its place that sends non-GPU tensors to
`torch_chunked_logprobs` here (plain PyTorch, the same maths). Priming uses it too.

The maths, as in TRL's kernel: z = (h W^T + b) * logit_scale, optional softcap
`c * tanh(z / c)`, divided by the temperature; log p(target) = z_t - logsumexp(z). Rows are processed
in chunks, each under activation checkpointing, so the full [tokens, vocab] logits never stay alive
for backward (the term that dominates GRPO's memory).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

OUTPUT_NAMES = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
CHUNK_ELEMENTS = 8 * 1024 * 1024  # logits elements per chunk on an accelerator: 32 MB of fp32 (memory_terms)
# on a CPU: 8 MB of fp32 per chunk. Host RAM is the tight budget there: a chunk's logits, softmax and gradients
# (~6 fp32 copies) set the GRPO step's peak RSS; 2M elements took ~100 MiB off the default job's peak, the same
# numbers bit for bit, no step time the bench could see (docs/results.md, "Host memory")
HOST_CHUNK_ELEMENTS = 2 * 1024 * 1024


def _logits(hidden, weight, bias, inv_t: float, softcap, logit_scale: float):
    """TRL's transform: scale, optional softcap, then temperature; in fp32."""
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_t


def _chunk_stats(hidden, weight, bias, targets, inv_t: float, softcap, logit_scale: float, want_entropy: bool):
    z = _logits(hidden, weight, bias, inv_t, softcap, logit_scale)
    log_norm = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    if want_entropy:
        p = torch.softmax(z, dim=-1)
        entropy = log_norm - (p * z).sum(-1)
    else:
        entropy = torch.zeros_like(log_probs)
    return log_probs, entropy


def _chunk_extras(hidden, weight, bias, targets, inv_t, softcap, logit_scale):
    with torch.no_grad():
        z = _logits(hidden, weight, bias, inv_t, softcap, logit_scale)
        log_p = torch.log_softmax(z, dim=-1)
        return (torch.logsumexp(2 * log_p, dim=-1), z.mean(-1), z.argmax(-1) == targets)


def torch_chunked_logprobs(hidden, weight, bias, targets, temperature, chunk_size=None,
                           final_logit_softcapping=None, logit_scale=1.0, outputs=("log_probs",)):
    """Same inputs and outputs as TRL's `ChunkedLogProbFunction.apply`, in plain PyTorch."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    else:
        weight = weight.to(hidden.dtype)
        bias = bias.to(hidden.dtype) if bias is not None else None
    inv_t = 1.0 / temperature
    want_entropy = "entropy" in outputs
    elements = HOST_CHUNK_ELEMENTS if hidden.device.type == "cpu" else CHUNK_ELEMENTS
    rows = max(1, elements // max(1, weight.shape[0]))
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    log_probs, entropy, extras = [], [], []
    for start in range(0, hidden.shape[0], rows):
        args = (hidden[start:start + rows], weight, bias, targets[start:start + rows], inv_t,
                final_logit_softcapping, logit_scale, want_entropy)
        if need_grad:
            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        log_probs.append(lp)
        entropy.append(ent)
        if any(name in outputs for name in OUTPUT_NAMES[2:]):
            extras.append(_chunk_extras(*args[:7]))
    # no scored token (an all-masked micro-batch, e.g. every completion cut off under mask_truncated_completions):
    # empty, but on the graph, as TRL's kernel is, so its masked_scatter gives a differentiable zero loss
    empty = (hidden[:0] @ weight.t()).sum(-1).float()
    result = {
        "log_probs": torch.cat(log_probs) if log_probs else empty,
        "entropy": torch.cat(entropy) if entropy else empty,
    }
    for i, name in enumerate(OUTPUT_NAMES[2:]):
        result[name] = torch.cat([e[i] for e in extras]) if extras else empty
    return tuple(result[name] if name == "log_probs" or name in outputs else None for name in OUTPUT_NAMES)
