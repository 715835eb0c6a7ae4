"""Sampled tokens through Llama-family layers written out with the projections fused (decode.fused, used by
decoding.py for rollouts and eval.samples where the adapter is plain LoRA).

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

decode.merge_lora=false: the same layers with the adapter unmerged (UnmergedLinear): each base weight read in place
(no merged copy: the projections' weights are not held twice while it generates) and the adapter added in 16 bits,
(x @ A^T) @ (scaling B)^T, the q/k/v and gate/up adapters concatenated, as PEFT's forward adds it; so the learned
part is not lost to the rounding of W + ΔW, at a few more small matmuls a layer.

decode.weights=int8 (opt-in, CPU): the base weights (frozen while the LoRA trains) are quantized once per model, not
per call: each fused group (q/k/v, o, gate/up, down, and the LM head) to int8 with one scale per output row, after
SmoothQuant's per-input-channel rescaling (W * s, x / s, s = sqrt(max|x_j| / max|W_j|), the activations' maxima
recorded once, on the first call's prompts through the merged 16-bit layers), packed for FBGEMM's dynamic int8
linear (internals.int8_prepack / int8_linear). The adapter is not merged into them: each call adds it unmerged in
16 bits, (x @ A^T) @ (scaling B)^T with the q/k/v and gate/up adapters concatenated (one pair of small matmuls a
group), so the learned part is sampled exactly and nothing is repacked as the adapter changes (repacking every weight
each call costs more than a short rollout saves on 2 cores). Why the rescaling: without it FBGEMM's one activation
scale a tensor is set by a few outlier channels (the down projection's input most), far from the 16-bit layers'
log-probs. Sampled tokens then come from a slightly different distribution than the trainer's (its log-probs go to TRL
as always; tests/test_decode_int8.py measures the gap); resolve() turns the importance-sampling correction on, per
token. The packed base (~1 byte a parameter) lives as long as the model (`int8_base`), rebuilt if a base weight
changes (a merge).

Supported: model_type llama, mistral, qwen2 (q/k/v biases) and qwen3 (RMSNorm of each head's query and key before
RoPE, as Qwen3Attention) with SiLU MLPs, no sliding window, on 16-bit weights (`unsupported()` says why not; the
plain loop runs then).

Shapes: B rows, P prompt positions (left-padded), N new tokens, H query heads, KV key/value heads, D head size.
"""
from __future__ import annotations

import weakref
from typing import Optional

from lowvram_grpo.core import internals
from lowvram_grpo.settings.plans import FUSED_TYPES

SUPPORTED_TYPES = FUSED_TYPES  # settings.plans: the one list, read by resolve before any model
WEIGHTS = ("bf16", "int8")  # decode.weights as resolved: the model's own 16-bit (or float32) weights | int8 (FBGEMM)


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


_MERGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # inner model -> (_merged_key, merged_copies)
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()  # models whose body frees their merged copies (_hook_body)
_optimizer_steps = [0, None]  # optimizer steps taken in this process, the hook's handle (_count_optimizer_steps)


def _count_optimizer_steps() -> None:
    """Count every optimizer step in this process (torch's global post-step hook; bitsandbytes' optimizers too): a
    step that writes an adapter weight past its version counter still changes _merged_key."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _optimizer_steps[1] is None:
        def count(optimizer, args, kwargs):
            _optimizer_steps[0] += 1
        _optimizer_steps[1] = register_optimizer_step_post_hook(count)


def _merged_key(inner) -> tuple:
    """What merged_copies depend on: the optimizer steps taken, and per projection (and the head) its base weight's
    storage and version, PEFT's merged / disabled flags, and each active adapter's name, A and B storage and version
    (torch's in-place write counter: an optimizer step, a load_state_dict) and scaling."""
    modules = _projections(inner)
    state = []
    for module in modules:
        base = _base_layer(module).weight
        entry = [base.data_ptr(), internals.tensor_version(base), bool(getattr(module, "merged", False)),
                 bool(getattr(module, "disable_adapters", False))]
        for name in getattr(module, "active_adapters", ()) if hasattr(module, "lora_A") else ():
            if name in module.lora_A:
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                entry += [name, a.data_ptr(), internals.tensor_version(a), b.data_ptr(), internals.tensor_version(b),
                          float(module.scaling[name])]
        state.append(tuple(entry))
    return _optimizer_steps[0], tuple(state)


def _hook_body(inner) -> None:
    """Once per model: a forward pre-hook on its decoder body (every forward of the trainer and of priming passes it;
    the fused layers do not) that frees the merged copies when the forward has gradients (a training step), so they
    never sit beside a step's activations; no-grad forwards (held-out answers, log-probs) leave them."""
    if inner in _HOOKED:
        return
    owner = weakref.ref(inner)

    def drop(body, args):
        import torch

        model = owner()
        if torch.is_grad_enabled() and model is not None:
            _MERGED.pop(model, None)

    inner.model.register_forward_pre_hook(drop)
    _HOOKED.add(inner)


def merged_copies(inner) -> dict:
    """FusedLayers' merged weights for `inner`: layer index -> {qkv, o, gate_up, down: (weight, bias or None)}, and
    'head' -> (weight, bias); each a new tensor of PEFT's W + ΔW (merged_weight), q/k/v and gate/up concatenated.
    Built on the first sampled call and reused by the next ones while the adapter is unchanged (_merged_key: no
    optimizer step, no write, no switch since): the rollouts of one step (dynamic sampling's draws, a tool run's
    turns) share one merge. Freed by the next training forward (_hook_body) or replaced when the key changes (the
    old copies first: one set alive at most)."""
    import torch

    _count_optimizer_steps()
    key = _merged_key(inner)
    held = _MERGED.get(inner)
    if held is not None and held[0] == key:
        return held[1]
    _MERGED.pop(inner, None)
    copies = {}
    with torch.no_grad():
        for index, layer in enumerate(inner.model.layers):
            groups = _groups(layer)
            q, k, v = (_merged(m) for m in groups["qkv"])
            gate, up = (_merged(m) for m in groups["gate_up"])
            copies[index] = dict(qkv=(torch.cat([q[0], k[0], v[0]]),                          # [(H + 2 KV) D, hidden]
                                      _cat_bias([q[1], k[1], v[1]], [q[0], k[0], v[0]])),
                                 o=_merged(groups["o"][0]),
                                 gate_up=(torch.cat([gate[0], up[0]]),                        # [2 intermediate, hidden]
                                          _cat_bias([gate[1], up[1]], [gate[0], up[0]])),
                                 down=_merged(groups["down"][0]))
        copies["head"] = _merged(inner.get_output_embeddings())
    _MERGED[inner] = (key, copies)
    _hook_body(inner)
    return copies


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
    """The model's layers with fused weights, and a KV cache for B rows of up to `length` positions.
    `weights` (one of WEIGHTS): 'bf16' multiplies in the model's dtype: with `merged`, copies of the weights with
    the adapter merged, q/k/v and gate/up concatenated (F.linear, one matmul a group); without, the base weights
    read in place (no copy) plus the adapter unmerged (UnmergedLinear); 'int8' multiplies with `int8` (int8_base's
    packed base weights) plus the adapter unmerged (Int8Linear). `record` (bf16 only): a dict that gets each matmul
    input's per-channel max |x| [in] of the first forward, by (layer index, group) and 'head' (what
    build_int8_base smooths with)."""
    def __init__(self, inner, batch: int, length: int, weights: str = "bf16", int8=None, record=None,
                 merged: bool = True):
        import torch
        import torch.nn.functional as F

        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
        if weights == "int8" and int8 is None:
            raise ValueError("weights='int8' needs int8=int8_base(...) (the packed base weights)")
        unmerged = weights == "bf16" and not merged and record is None
        self.linear = F.linear if weights == "bf16" and record is None and merged else _call

        def pack(key, weight, bias, modules=()):
            if weights == "int8":
                return (Int8Linear(*int8[key], lora=_unmerged_lora(modules, dtype)),)
            if record is not None:
                return (_Recording(record, key, weight, bias),)
            if unmerged:
                return (UnmergedLinear([_base_weight(m) for m in modules], _unmerged_lora(modules, dtype)),)
            return weight, bias
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
        merged = merged_copies(inner) if weights == "bf16" and not unmerged else None  # held while the adapter holds
        for index, layer in enumerate(body.layers):
            attention = layer.self_attn
            groups = _groups(layer)
            if merged is None:  # the base packed already (int8), or read in place (unmerged): nothing merged here
                fused = {name: (None, None) for name in groups}
            else:
                fused = merged[index]
            packed = {name: pack((index, name), *fused[name], groups[name]) for name in groups}
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon),
                norm2=(layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon),
                q_norm=_norm(getattr(attention, "q_norm", None)), k_norm=_norm(getattr(attention, "k_norm", None)),
                keys=torch.zeros(batch, self.kv_heads, length, self.head_dim, dtype=dtype, device=device),
                values=torch.zeros(batch, self.kv_heads, length, self.head_dim, dtype=dtype, device=device),
                **packed,
            ))
        self.final_norm = (body.norm.weight.detach(), body.norm.variance_epsilon)
        head = inner.get_output_embeddings()
        self.head = pack("head", *(merged["head"] if merged is not None else (None, None)), (head,))

    def forward(self, ids, positions, start: int, mask, spread=None):
        """Logits of the last position [B, V] for tokens `ids` [B, T] at `positions` [B, T], written to cache
        positions start..start+T-1; `mask` [B, 1, T, start+T] (True = attend). `spread` [B'] (a prefill, start 0, of
        U distinct prompts): cache row b gets the keys and values of prompt spread[b]; the logits stay [U, V]."""
        import torch.nn.functional as F

        linear = self.linear                                                              # F.linear, or int8
        batch, steps = ids.shape
        hidden = self.body.embed_tokens(ids)                                              # [B, T, hidden]
        cos, sin = self.body.rotary_emb(hidden, positions)                                # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                                     # [B, 1, T, D]
        end = start + steps
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer in self.layers:
            x = rms_norm(hidden, *layer["norm1"])
            qkv = linear(x, *layer["qkv"])                                              # [B, T, (H+2KV) D]
            q = qkv[..., :q_size].view(batch, steps, self.heads, self.head_dim)              # [B, T, H, D]
            k = qkv[..., q_size:q_size + kv_size].view(batch, steps, self.kv_heads, self.head_dim)
            if layer["q_norm"] is not None:                                               # Qwen3: per head, before RoPE
                q, k = rms_norm(q, *layer["q_norm"]), rms_norm(k, *layer["k_norm"])
            q, k = q.transpose(1, 2), k.transpose(1, 2)                                   # [B, heads, T, D]
            v = qkv[..., q_size + kv_size:].view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
            if spread is None:
                layer["keys"][:, :, start:end] = _rope(k, cos, sin)                       # [B, KV, T, D]
                layer["values"][:, :, start:end] = v
                keys, values = layer["keys"][:, :, :end], layer["values"][:, :, :end]
            else:                                                                         # the prefill, start 0
                keys, values = _rope(k, cos, sin), v                                      # [U, KV, T, D]
                layer["keys"][:, :, :end] = keys[spread]                                  # [B', KV, T, D]
                layer["values"][:, :, :end] = values[spread]
            attended = F.scaled_dot_product_attention(
                _rope(q, cos, sin), keys, values, attn_mask=mask,
                scale=self.scale, enable_gqa=self.kv_heads != self.heads)                # [B, H, T, D]
            hidden = hidden + linear(attended.transpose(1, 2).reshape(batch, steps, q_size), *layer["o"])
            x = rms_norm(hidden, *layer["norm2"])
            gate, up = linear(x, *layer["gate_up"]).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, *layer["down"])
        last = rms_norm(hidden[:, -1], *self.final_norm)                                  # [B, hidden]
        return linear(last, *self.head)                                                 # [B, V]


def decode(inner, input_ids, attention_mask, *, max_new_tokens: int, eos_token_ids, pad_token_id, pick,
           weights: str = "bf16", merged: bool = True, shared=None):
    """decoding.decode's contract for sampled tokens on the fused layers; `pick(logits [B, V]) -> tokens [B]`;
    `weights`, `merged`: FusedLayers'; `shared`: decoding.shared_rows' (first [U], group [B]): each distinct prompt
    prefilled once and its keys and values copied to its rows (None: every row prefilled)."""
    import torch

    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    length = prompt_len + max_new_tokens
    valid = torch.cat([attention_mask.bool(), attention_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
    positions = prompt_positions(attention_mask)
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    prefill_mask = (causal[None] & valid[:, None, :prompt_len]) | torch.eye(prompt_len, dtype=torch.bool,
                                                                             device=device)[None]
    int8 = int8_base(inner) if weights == "int8" else None
    if weights == "int8" and int8 is None:  # once per model: the prefill on the 16-bit layers gives the smoothing
        recorded = {}
        FusedLayers(inner, batch, prompt_len, "bf16", record=recorded).forward(input_ids, positions, 0,
                                                                               prefill_mask[:, None])
        int8 = build_int8_base(inner, recorded)
    layers = FusedLayers(inner, batch, length, weights, int8=int8, merged=merged)
    if shared is None:
        logits = layers.forward(input_ids, positions, 0, prefill_mask[:, None])           # [B, V]
    else:
        first, group = shared
        logits = layers.forward(input_ids[first], positions[first], 0, prefill_mask[first][:, None],
                                spread=group)[group]                                      # [U, V] -> [B, V]

    def forward_next(token, last, step):
        width = prompt_len + step + 1
        return layers.forward(token[:, None], last, width - 1, valid[:, None, None, :width])

    return token_loop(input_ids, positions[:, -1:], logits, forward_next, pick, max_new_tokens=max_new_tokens,
                      eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)


def _groups(layer) -> dict:
    """A decoder layer's fused groups: name -> the projection modules concatenated (in FusedLayers' order)."""
    attention, mlp = layer.self_attn, layer.mlp
    return dict(qkv=(attention.q_proj, attention.k_proj, attention.v_proj), o=(attention.o_proj,),
                gate_up=(mlp.gate_proj, mlp.up_proj), down=(mlp.down_proj,))


def _projections(inner) -> list:
    """Every module the fused layers read a weight of: each layer's projections in _groups' order, then the head."""
    return [m for layer in inner.model.layers for group in _groups(layer).values() for m in group] + [
        inner.get_output_embeddings()]


def _base_layer(module):
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _call(x, op):
    """FusedLayers.linear where each weight entry is one callable (int8, or recording)."""
    return op(x)


class _Recording:
    """F.linear(x, weight, bias) that keeps the per-channel max |x| [in] (float32) of its first call in
    `record[key]`."""
    def __init__(self, record: dict, key, weight, bias):
        self.record, self.key, self.weight, self.bias = record, key, weight, bias

    def __call__(self, x):
        import torch.nn.functional as F

        if self.key not in self.record:
            self.record[self.key] = x.detach().float().abs().reshape(-1, x.shape[-1]).amax(0)
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """x [..., in] -> [..., out] in x's dtype: FBGEMM's dynamic int8 linear on the smoothed base weight (x / s times
    W * s, internals.int8_linear; its bias inside), plus the adapter unmerged: (x @ A^T) @ B^T, A [R, in] the active
    adapters' lora_A weights concatenated over the group's projections, B [out, R] their lora_B weights times PEFT's
    scaling, block by block (zero elsewhere); none when no adapter is active."""
    def __init__(self, packed, inverse_scale, lora=None):
        self.packed, self.inverse_scale, self.lora = packed, inverse_scale, lora

    def __call__(self, x):
        import torch.nn.functional as F

        out = internals.int8_linear(x * self.inverse_scale, self.packed)
        if self.lora is not None:
            out = out + F.linear(F.linear(x, self.lora[0]), self.lora[1])
        return out


def _base_weight(module):
    """(weight, bias or None) of `module`'s base layer, the tensors themselves (detached views, never copies)."""
    base = _base_layer(module)
    return base.weight.detach(), None if getattr(base, "bias", None) is None else base.bias.detach()


class UnmergedLinear:
    """x [..., in] -> [..., out]: each base weight of a fused group read in place (F.linear per projection, outputs
    concatenated in order: [..., sum of outs]), plus the adapter unmerged as Int8Linear adds it, (x @ A^T) @ B^T
    (`lora`: _unmerged_lora's (A, B), or None). PEFT's lora.Linear forward computes the same terms, base(x) +
    lora_B(lora_A(x)) * scaling, in the same dtype; no weight is copied or written."""
    def __init__(self, bases, lora=None):
        self.bases, self.lora = bases, lora

    def __call__(self, x):
        import torch
        import torch.nn.functional as F

        outs = [F.linear(x, weight, bias) for weight, bias in self.bases]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.lora is not None:
            out = out + F.linear(F.linear(x, self.lora[0]), self.lora[1])
        return out


def _unmerged_lora(modules, dtype):
    """(A [R, in], B [out, R]) of the active, not already merged LoRA adapters of `modules` (a fused group, outputs
    concatenated in order), in `dtype`, or None. PEFT's plain LoRA arithmetic (what lora.Linear.get_delta_weight
    computes as B @ A * scaling, unmerged; decoding.mergeable admits only plain LoRA here)."""
    import torch

    rows, downs = [], []
    for module in modules:
        out = _base_layer(module).weight.shape[0]
        names = ([] if not hasattr(module, "lora_A") or module.disable_adapters or module.merged else
                 [name for name in module.active_adapters if name in module.lora_A])
        rows.append((out, [(module.lora_A[n].weight.detach(), module.lora_B[n].weight.detach() * module.scaling[n])
                           for n in names]))
    if not any(pairs for _, pairs in rows):
        return None
    total_out = sum(out for out, _ in rows)
    rank = sum(a.shape[0] for _, pairs in rows for a, _ in pairs)
    up = torch.zeros(total_out, rank, dtype=dtype, device=_base_layer(modules[0]).weight.device)
    row = col = 0
    for out, pairs in rows:
        for a, b in pairs:
            downs.append(a.to(dtype))
            up[row:row + out, col:col + a.shape[0]] = b.to(dtype)
            col += a.shape[0]
        row += out
    return torch.cat(downs), up


# the packed base weights of each model (a weak key: they go with the model), with the key they were packed for
_INT8_BASES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _int8_key(inner) -> tuple:
    """What the packed base depends on: every base weight's storage and version, and whether PEFT merged into it."""
    modules = _projections(inner)
    return tuple((w.data_ptr(), internals.tensor_version(w), bool(getattr(m, "merged", False)))
                 for m in modules for w in [_base_layer(m).weight])


def int8_base(inner):
    """The packed base weights build_int8_base made for `inner`, or None (never built, or a base weight changed)."""
    held = _INT8_BASES.get(inner)
    return held[1] if held is not None and held[0] == _int8_key(inner) else None


def build_int8_base(inner, recorded: dict) -> dict:
    """Pack `inner`'s base weights for Int8Linear, once: key (layer index, group) or 'head' -> (packed int8 weight with
    its bias, inverse smoothing scale [in] in the model's dtype). Each group's weights are concatenated as
    FusedLayers does; the smoothing s_j = sqrt(max|x_j| / max_i |W_ij|) (SmoothQuant, alpha 0.5) from `recorded`
    (the first call's prefill: per-channel max |x| by the same keys). Held for the model (int8_base) until a base
    weight changes. A layer PEFT merged keeps W + ΔW in its base weight: packed as it is (its adapter is then
    never added)."""
    import torch

    dtype = inner.model.embed_tokens.weight.dtype

    def pack(key, modules):
        bases = [_base_layer(m) for m in modules]
        weight = torch.cat([b.weight.detach() for b in bases]).float()                     # [out, in]
        bias = _cat_bias([None if b.bias is None else b.bias.detach() for b in bases], [b.weight for b in bases])
        seen = recorded[key].clamp(min=1e-5)
        scale = (seen / weight.abs().amax(0).clamp(min=1e-5)).sqrt().clamp(min=1e-5)      # [in]
        return internals.int8_prepack(weight * scale, bias), (1 / scale).to(dtype)

    packed = {(index, name): pack((index, name), modules)
              for index, layer in enumerate(inner.model.layers) for name, modules in _groups(layer).items()}
    packed["head"] = pack("head", (inner.get_output_embeddings(),))
    _INT8_BASES[inner] = (_int8_key(inner), packed)
    return packed


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
