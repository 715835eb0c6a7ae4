"""What our decode loop (decoding.py, fused_decode.py) copies from or reaches into transformers 5.17 and PEFT 0.21,
read from the installed source: each contract names the upstream lines a piece mirrors and the lines of ours that
mirror them, both compared as normalized text (stripped lines, comments and blank lines dropped), so an upstream
change fails here and so does a copy of ours that drifted from them. Where the piece can run, it is also run
against upstream's (bit-equal on bf16 inputs); whole functions we call rather than copy are pinned by a hash
of their normalized source."""
import hashlib
import inspect

import pytest
import torch

from lowvram_grpo.model import decoding
from lowvram_grpo.core import internals
from lowvram_grpo.model import fused_decode


def _normalized(text: str) -> str:
    lines = (line.split("  #")[0].strip() for line in inspect.cleandoc(text).splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("#"))


def _source(obj) -> str:
    return _normalized(inspect.getsource(obj))


def _digest(obj) -> str:
    return hashlib.sha256(_source(obj).encode()).hexdigest()[:16]


def _upstream(path: str):
    """The object at 'module:Qualified.name' (a property's getter for a property)."""
    import importlib

    module, _, qualified = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return obj.fget if isinstance(obj, property) else obj


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # fused_decode.SUPPORTED_TYPES

# (what, upstream object, its lines our copy mirrors, our object, our lines that mirror them)
MIRRORED = [
    ("pad positions of a left-padded prompt",
     "transformers.generation.utils:GenerationMixin._prepare_position_ids_for_generation",
     """position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 0)""",
     fused_decode.prompt_positions,
     """position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 0)"""),
    ("each new token's position: the last one + 1",
     "transformers.generation.utils:GenerationMixin._update_model_kwargs_for_generation",
     """next_position_ids = (
        torch.arange(num_new_tokens, dtype=position_ids.dtype, device=position_ids.device).view(*required_dim)
        + position_ids[..., -1:]
        + 1
        )""",
     fused_decode.token_loop, "last = last + 1"),
    ("the attention mask grows by ones",
     "transformers.generation.utils:GenerationMixin._update_model_kwargs_for_generation",
     """model_kwargs[attention_mask_key] = torch.cat(
        [attention_mask, attention_mask.new_ones((attention_mask.shape[0], num_new_tokens))], dim=-1""",
     decoding.decode, "mask = torch.cat([attention_mask, attention_mask.new_ones(batch, max_new_tokens)], dim=1)"),
    ("rows that ended continue with the pad token; the draw",
     "transformers.generation.utils:GenerationMixin._sample",
     """probs = nn.functional.softmax(next_token_scores, dim=-1)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
        next_tokens = torch.argmax(next_token_scores, dim=-1)
        if has_eos_stopping_criteria:
        next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)""",
     fused_decode.token_loop, "token = torch.where(running, token, torch.full_like(token, pad_token_id))"),
    ("the pad token is the first eos when unset",
     "transformers.generation.utils:GenerationMixin._prepare_special_tokens",
     "pad_token_tensor = eos_token_tensor[0]",
     decoding._plan, "pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)"),
    ("causal and padding masks (the fused prefill)",
     "transformers.masking_utils:causal_mask_function", "return kv_idx <= q_idx",
     fused_decode.decode, "causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()"),
    ("the padding mask reads the 2-D attention mask at each key",
     "transformers.masking_utils:padding_mask_function", "return padding_mask[batch_idx, kv_idx]",
     fused_decode.decode, "prefill_mask = (causal[None] & valid[:, None, :prompt_len])"),
    ("LoRA layers off: PEFT's forward reads the base layer alone (merged_weights sets the flag)",
     "peft.tuners.lora.layer:Linear.forward",
     """if self.disable_adapters:
        if self.merged:
        self.unmerge()
        result = self.base_layer(x, *args, **kwargs)""",
     decoding.merged_weights, "internals.set_adapters_disabled(layer, True)"),
    ("the flag behind disable_adapters",
     "peft.tuners.tuners_utils:BaseTunerLayer.disable_adapters", "return self._disable_adapters",
     internals.set_adapters_disabled, "layer._disable_adapters = flag"),
    ("a merged layer's forward is its base layer (never merged twice)",
     "peft.tuners.lora.layer:Linear.forward",
     """elif self.merged:
        result = self.base_layer(x, *args, **kwargs)""",
     fused_decode.merged_weight,
     "if hasattr(module, \"lora_A\") and not module.disable_adapters and not module.merged:"),
] + [
    (f"{family}: RMSNorm",
     f"transformers.models.{family}.modeling_{family}:"
     f"{dict(qwen2='Qwen2', qwen3='Qwen3').get(family, family.title())}RMSNorm.forward",
     """input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)""",
     fused_decode.rms_norm,
     """dtype = x.dtype
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hidden.to(dtype)""")
    for family in FAMILIES
] + [
    (f"{family}: rotate_half", f"transformers.models.{family}.modeling_{family}:rotate_half",
     """x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)""",
     fused_decode._rope, "rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)")
    for family in FAMILIES
] + [
    (f"{family}: apply_rotary_pos_emb", f"transformers.models.{family}.modeling_{family}:apply_rotary_pos_emb",
     """q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)""",
     fused_decode._rope, "return x * cos + rotated * sin")
    for family in FAMILIES
] + [
    (f"{family}: attention scale", f"transformers.models.{family}.modeling_{family}:"
     f"{dict(qwen2='Qwen2', qwen3='Qwen3').get(family, family.title())}Attention.__init__",
     "self.scaling = self.head_dim**-0.5", fused_decode.FusedLayers.__init__, "self.scale = self.head_dim ** -0.5")
    for family in FAMILIES
] + [
    ("qwen3: q/k RMSNorm per head before RoPE", "transformers.models.qwen3.modeling_qwen3:Qwen3Attention.forward",
     """query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)""",
     fused_decode.FusedLayers.forward, "q, k = rms_norm(q, *layer[\"q_norm\"]), rms_norm(k, *layer[\"k_norm\"])"),
]


@pytest.mark.parametrize("what, upstream, theirs, ours, mine", MIRRORED, ids=[m[0] for m in MIRRORED])
def test_each_copied_piece_mirrors_the_installed_upstream_lines(what, upstream, theirs, ours, mine):
    assert _normalized(theirs) in _source(_upstream(upstream)), (f"{upstream} changed: re-read it, then "
                                                                 f"{ours.__qualname__}")
    assert _normalized(mine) in _source(ours), f"{ours.__qualname__} no longer mirrors {upstream}"


# Functions we call (not copy) whose behaviour the loop relies on, pinned whole: transformers' and PEFT's source as
# installed (transformers 5.17.0, peft 0.21.2). A new hash means: read the function, check the loop's use of it,
# then update the hash.
CALLED = {
    # the call's settings read as generate reads them (decoding._plan)
    "transformers.generation.utils:GenerationMixin._prepare_generation_config": "71e88b35f8721948",
    "transformers.generation.configuration_utils:GenerationConfig._get_default_generation_params": "a6d875cf3341565a",
    # the merge's arithmetic (fused_decode.merged_weight)
    "peft.tuners.lora.layer:Linear.get_delta_weight": "99fe13924ff36d63",
    # the warpers filtered_scores reproduces (also checked equal by tests/test_decoding.py)
    "transformers.generation.logits_process:TemperatureLogitsWarper.__call__": "4bf128f285016234",
    "transformers.generation.logits_process:TopKLogitsWarper.__call__": "acf2700767cbeb80",
    "transformers.generation.logits_process:TopPLogitsWarper.__call__": "54b3fe4076a4548c",
}


@pytest.mark.parametrize("upstream", sorted(CALLED))
def test_each_called_upstream_function_is_the_one_the_loop_was_written_for(upstream):
    assert _digest(_upstream(upstream)) == CALLED[upstream], f"{upstream} changed: check decoding.py's use of it"


def test_the_models_take_no_cache_position_and_our_loop_passes_none():
    """transformers 5.17 dropped `cache_position` from its models (a cache places the new keys at its own length):
    a copy that still passed it would be stale."""
    import importlib

    for family in decoding.LOOP_TYPES:
        module = importlib.import_module(f"transformers.models.{family.removesuffix('_text')}.modeling_"
                                         f"{family.removesuffix('_text')}")
        assert "cache_position" not in inspect.getsource(module), family
    assert "cache_position" not in _source(decoding.decode).replace("no cache_position", "")
    assert "cache_position" not in inspect.getsource(fused_decode)


def test_the_copies_compute_what_upstream_computes_bit_for_bit():
    """bf16 inputs: rms_norm against each family's RMSNorm module, _rope against apply_rotary_pos_emb,
    prompt_positions against GenerationMixin._prepare_position_ids_for_generation."""
    import importlib

    from transformers import GenerationMixin

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=generator) * 3).bfloat16()
    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        norm = getattr(module, f"{dict(qwen2='Qwen2', qwen3='Qwen3').get(family, family.title())}RMSNorm")(64, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(64, generator=generator) + 0.5)
            norm = norm.bfloat16()
            assert torch.equal(fused_decode.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)), family
        q = torch.randn(3, 4, 5, 16, generator=generator).bfloat16()
        k = torch.randn(3, 2, 5, 16, generator=generator).bfloat16()
        cos = torch.randn(3, 1, 5, 16, generator=generator).bfloat16()
        sin = torch.randn(3, 1, 5, 16, generator=generator).bfloat16()
        q_theirs, k_theirs = module.apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
        assert torch.equal(fused_decode._rope(q, cos, sin), q_theirs) and torch.equal(fused_decode._rope(k, cos, sin),
                                                                                     k_theirs), family
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    theirs = GenerationMixin._prepare_position_ids_for_generation(None, mask, {"attention_mask": mask})
    assert torch.equal(fused_decode.prompt_positions(mask), theirs)


def test_the_generation_settings_are_those_of_the_installed_generation_config():
    """Every GenerationConfig setting is the loop's (LOOP_SETTINGS), changes no token (NO_TOKEN_EFFECT), or is held
    at transformers' own unset value for the loop to run (decoding._neutral_settings, derived from GenerationConfig
    itself, so a key a newer transformers adds falls back by itself). The names the loop implements exist."""
    from transformers import GenerationConfig

    keys = {key for key in vars(GenerationConfig()) if not key.startswith("_")} | {"_from_model_config"}
    assert decoding.LOOP_SETTINGS <= keys and decoding.NO_TOKEN_EFFECT <= keys
    assert set(decoding._neutral_settings()) == {k for k in keys if not k.startswith("_")} - decoding.LOOP_SETTINGS \
        - decoding.NO_TOKEN_EFFECT
    for new_key in ("top_h", "watermarking_config", "max_time", "dola_layers"):
        assert new_key in decoding._neutral_settings()


def test_every_lora_config_option_is_classified_and_peft_defaults_read_as_unset():
    """Each LoraConfig field of the installed PEFT: its default is 'unset' to options_beyond_merge (so a plain
    adapter_config.json has no option beyond the merge), and every field PEFT tags as a LoRA variant
    (metadata is_lora_variant, or init_lora_weights' lora_variants) is beyond it when set."""
    import dataclasses

    from peft import LoraConfig

    defaults = LoraConfig().to_dict()
    assert decoding.options_beyond_merge(defaults) == []
    for field in dataclasses.fields(LoraConfig):
        if field.metadata.get("is_lora_variant"):
            assert field.name not in decoding.MERGE_OPTIONS, field.name
            assert decoding.options_beyond_merge({**defaults, field.name: True}) == [field.name], field.name
        for variant in field.metadata.get("lora_variants", ()):
            assert variant not in decoding.PLAIN_INITS
            assert decoding.options_beyond_merge({**defaults, field.name: variant}) == [field.name]
    assert decoding.options_beyond_merge({**defaults, "lora_bias": True}) == ["lora_bias"]
    assert decoding.options_beyond_merge({**defaults, "use_rslora": True, "lora_alpha": 32, "r": 4,
                                          "alpha_pattern": {"q_proj": 8}}) == []
    assert decoding.options_beyond_merge({**defaults, "a_newer_peft_option": 3}) == ["a_newer_peft_option"]
