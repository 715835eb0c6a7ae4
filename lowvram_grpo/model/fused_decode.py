"""Sampled tokens through Llama-family layers written out with the adapter merged and the projections fused
(decode.fused, used by decoding.py for rollouts and eval.samples where decode.merge_lora holds).

Why: a CPU decode step of transformers' Llama forward runs ~500 small ops per layer (views, dtype casts, the
KV cache's concatenation, LoRA's disabled branches, mask building): at 16 rows of SmolLM2-135M more time than its
matmuls (bench/decode_step.py). Here a layer is ~30 ops: one matmul for q/k/v together and one for gate/up
together (the weights merged with the adapter, W + scale * B @ A, concatenated once per call), RoPE from the
model's own rotary module (its scaling included), a preallocated KV cache written in place, one SDPA with
grouped-query heads, RMSNorm as transformers computes it. Greedy answers never come here (they stay token for
token those of transformers' generate); sampled ones come from the same distribution up to 16-bit rounding of
the merged weights (tests/test_decoding.py compares the logits with transformers' forward at every step, and in
bf16 16 greedy tokens with transformers' generate on the weights PEFT merges, for every RoPE type; the lines copied
from transformers are read from its installed source by tests/test_decoding_contracts.py).

Supported: model_type llama, mistral, qwen2 (q/k/v biases) and qwen3 (RMSNorm of each head's query and key before
RoPE, as Qwen3Attention) with SiLU MLPs, no sliding window, on 16-bit weights (`unsupported()` says why not; the
plain loop runs then).

Shapes: B rows, P prompt positions (left-padded), N new tokens, H query heads, KV key/value heads, D head size.
"""
from __future__ import annotations

from typing import Optional

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(inner) -> Optional[str]:
    """Why `inner` (a transformers causal LM) cannot decode here, or None."""
    import torch

    config = inner.config
    if config.model_type not in SUPPORTED_TYPES:
        return f"model_type {config.model_type} (fused layers cover {', '.join(SUPPORTED_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU without bias"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    if getattr(config, "use_sliding_window", False) or (getattr(config, "sliding_window", None) and
                                                        config.model_type == "mistral"):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return f"layers other than full attention ({', '.join(sorted(set(config.layer_types) - {'full_attention'}))})"
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if not layers:
        return "no decoder layers at model.layers"
    attention = layers[0].self_attn
    if hasattr(attention, "q_norm") != (config.model_type == "qwen3"):
        return "q/k norms other than Qwen3's"
    for module in (attention.q_proj, layers[0].mlp.gate_proj):
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        weight = getattr(base, "weight", None)
        if weight is None or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return "quantized base weights"
    return None


def merged_weight(module):
    """A new tensor: `module`'s weight with its active LoRA adapters merged by PEFT's own arithmetic
    (lora.Linear.get_delta_weight, summed in float32, rounded once to the weight's dtype); the base weight itself
    (never a copy, never written) for a plain Linear, a layer with its adapters off, or one PEFT already merged
    (its weight holds W + ΔW: merged once, never twice). Callers merge only what decoding.mergeable allows."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    weight = base.weight.detach()
    if hasattr(module, "lora_A") and not module.disable_adapters and not module.merged:
        names = [name for name in module.active_adapters if name in module.lora_A]
        if names:
            delta = sum(module.get_delta_weight(name).float() for name in names)
            weight = (weight.float() + delta).to(weight.dtype)
    return weight


def _merged(module):
    """(merged_weight(module), its base bias or None)."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    bias = None if getattr(base, "bias", None) is None else base.bias.detach()
    return merged_weight(module), bias


def _cat_bias(biases, weights):
    import torch

    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm, op for op (float32 statistics, the weight times the input-dtype result)."""
    import torch

    dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _norm(module):
    """(weight, eps) of an RMSNorm module, None for None."""
    return None if module is None else (module.weight.detach(), module.variance_epsilon)


def _rope(x, cos, sin):
    """x [B, heads, T, D]; cos/sin [B, 1, T, D]: transformers' apply_rotary_pos_emb for one tensor."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FusedLayers:
    """The model's layers with merged, fused weights, and a KV cache for B rows of up to `length` positions."""
    def __init__(self, inner, batch: int, length: int):
        import torch

        config = inner.config
        body = inner.model
        self.inner, self.body = inner, body
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.layers = []
        dtype = body.embed_tokens.weight.dtype
        device = body.embed_tokens.weight.device
        for layer in body.layers:
            attention, mlp = layer.self_attn, layer.mlp
            q, k, v = (_merged(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj))
            o = _merged(attention.o_proj)
            gate, up = _merged(mlp.gate_proj), _merged(mlp.up_proj)
            down = _merged(mlp.down_proj)
            qkv_weight = torch.cat([q[0], k[0], v[0]])                     # [(H + 2 KV) D, hidden]
            gate_up = torch.cat([gate[0], up[0]])                          # [2 intermediate, hidden]
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon),
                qkv=(qkv_weight, _cat_bias([q[1], k[1], v[1]], [q[0], k[0], v[0]])), o=o,
                norm2=(layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon),
                gate_up=(gate_up, _cat_bias([gate[1], up[1]], [gate[0], up[0]])), down=down,
                q_norm=_norm(getattr(attention, "q_norm", None)), k_norm=_norm(getattr(attention, "k_norm", None)),
                keys=torch.zeros(batch, self.kv_heads, length, self.head_dim, dtype=dtype, device=device),
                values=torch.zeros(batch, self.kv_heads, length, self.head_dim, dtype=dtype, device=device),
            ))
        self.final_norm = (body.norm.weight.detach(), body.norm.variance_epsilon)
        head = inner.get_output_embeddings()
        self.head = _merged(head)

    def forward(self, ids, positions, start: int, mask):
        """Logits of the last position [B, V] for tokens `ids` [B, T] at `positions` [B, T], written to cache
        positions start..start+T-1; `mask` [B, 1, T, start+T] (True = attend)."""
        import torch.nn.functional as F

        batch, steps = ids.shape
        hidden = self.body.embed_tokens(ids)                                              # [B, T, hidden]
        cos, sin = self.body.rotary_emb(hidden, positions)                                # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                                     # [B, 1, T, D]
        end = start + steps
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer in self.layers:
            x = rms_norm(hidden, *layer["norm1"])
            qkv = F.linear(x, *layer["qkv"])                                              # [B, T, (H+2KV) D]
            q = qkv[..., :q_size].view(batch, steps, self.heads, self.head_dim)              # [B, T, H, D]
            k = qkv[..., q_size:q_size + kv_size].view(batch, steps, self.kv_heads, self.head_dim)
            if layer["q_norm"] is not None:                                               # Qwen3: per head, before RoPE
                q, k = rms_norm(q, *layer["q_norm"]), rms_norm(k, *layer["k_norm"])
            q, k = q.transpose(1, 2), k.transpose(1, 2)                                   # [B, heads, T, D]
            v = qkv[..., q_size + kv_size:].view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
            layer["keys"][:, :, start:end] = _rope(k, cos, sin)                           # [B, KV, T, D]
            layer["values"][:, :, start:end] = v
            attended = F.scaled_dot_product_attention(
                _rope(q, cos, sin), layer["keys"][:, :, :end], layer["values"][:, :, :end], attn_mask=mask,
                scale=self.scale, enable_gqa=self.kv_heads != self.heads)                # [B, H, T, D]
            hidden = hidden + F.linear(attended.transpose(1, 2).reshape(batch, steps, q_size), *layer["o"])
            x = rms_norm(hidden, *layer["norm2"])
            gate, up = F.linear(x, *layer["gate_up"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, *layer["down"])
        last = rms_norm(hidden[:, -1], *self.final_norm)                                  # [B, hidden]
        return F.linear(last, *self.head)                                                 # [B, V]


def decode(inner, input_ids, attention_mask, *, max_new_tokens: int, eos_token_ids, pad_token_id, pick):
    """decoding.decode's contract for sampled tokens on the fused layers; `pick(logits [B, V]) -> tokens [B]`."""
    import torch

    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    length = prompt_len + max_new_tokens
    layers = FusedLayers(inner, batch, length)
    valid = torch.cat([attention_mask.bool(), attention_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
    positions = prompt_positions(attention_mask)
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    prefill_mask = (causal[None] & valid[:, None, :prompt_len]) | torch.eye(prompt_len, dtype=torch.bool,
                                                                             device=device)[None]
    logits = layers.forward(input_ids, positions, 0, prefill_mask[:, None])               # [B, V]

    def forward_next(token, last, step):
        width = prompt_len + step + 1
        return layers.forward(token[:, None], last, width - 1, valid[:, None, None, :width])

    return token_loop(input_ids, positions[:, -1:], logits, forward_next, pick, max_new_tokens=max_new_tokens,
                      eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)


def prompt_positions(attention_mask):
    """Position ids [B, P] of a left-padded prompt, transformers 5.17's GenerationMixin
    ._prepare_position_ids_for_generation line for line (pads at 0; tests/test_decoding.py reads its source)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    return position_ids


def token_loop(input_ids, last, logits, forward_next, pick, *, max_new_tokens: int, eos_token_ids, pad_token_id):
    """The per-token loop both decoders share (decoding.decode on transformers' layers, decode here): pick a token
    from `logits` [B, V], pad the rows that ended, stop when every row ended or at max_new_tokens, else
    `forward_next(token [B], position [B, 1], step) -> logits [B, V]`. Returns prompt + new tokens [B, P + n]."""
    import torch

    device = input_ids.device
    stop = torch.tensor(sorted(set(eos_token_ids)), device=device) if eos_token_ids else None
    running = torch.ones(input_ids.shape[0], dtype=torch.bool, device=device)
    new = []
    for step in range(max_new_tokens):
        token = pick(logits)                                                              # [B]
        if pad_token_id is not None:
            token = torch.where(running, token, torch.full_like(token, pad_token_id))
        new.append(token)
        if stop is not None:
            running &= ~torch.isin(token, stop)
            if not bool(running.any()):
                break
        if step == max_new_tokens - 1:
            break
        last = last + 1
        logits = forward_next(token, last, step)
    if not new:
        return input_ids
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)
