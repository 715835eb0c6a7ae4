"""The transformers generation path at the machine's pace: one decode loop for the rollouts, priming's samples and
the held-out answers, wherever a model generates with transformers (the hf backend; not vLLM, not unsloth's own).

`install(model, settings)` (backends.load_model, after resolve() decided `settings`) makes the model's `generate`
this loop, so TRL's rollouts (TRL 1.15 calls the unwrapped model's `generate` with its GenerationConfig), our
evaluation and priming reach it with no change of theirs; a call this loop does not cover (beams, a repetition
penalty, min_p, logits processors, scores asked for ...) goes to transformers' own `generate`, unchanged.

The loop: one prefill of the left-padded prompts, then one forward per new token on the KV cache, as transformers'
`generate` does (the same position ids, cache positions and attention mask, so greedy answers are identical to
it, tests/test_decoding.py), without its per-token machinery. Its levers, each one setting of `decode:`:

- `sampler`: 'inverse_cdf' draws one uniform number per row and inverts the cumulative distribution of the
  (temperature, top-k, top-p) probabilities; 'multinomial' is transformers' draw (torch.multinomial, which draws a
  full-vocabulary exponential per token: ~13 ms of a ~53 ms decode step of 16 SmolLM2 sequences on 2 CPU cores).
  Same distribution, a different random stream (tests/test_decoding.py compares token frequencies).
- `merge_lora`: sampled tokens (rollouts, eval.samples) come from the adapter merged into a copy of the 16-bit
  weights, made once per call: one matmul per layer instead of three (the base's and LoRA's A and B) and no
  dropout/scale ops. Never into 4-bit weights (resolve refuses it); greedy answers always use the unmerged adapter,
  so the held-out columns are exactly those of the unmerged model. The merged copy holds the projections' weights
  once more while it generates (SmolLM2-135M: ~0.2 GB).
- `fused`: sampled tokens through fused_decode.py's Llama-family layers (merged weights, q/k/v and gate/up each one
  matmul, ~30 ops a layer instead of transformers' ~500) where the architecture is covered; else the loop above.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

SAMPLERS = ("inverse_cdf", "multinomial")
# The model types whose greedy answers from this loop are token for token those of transformers' generate, checked
# on a left-padded batch past the sliding window with a LoRA adapter (tests/test_families.py, tiny models of each,
# float32). Any other architecture keeps transformers' generate, said once in the run's log (`install`).
LOOP_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "gemma3_text", "gemma4_text", "gpt_oss", "smollm3")


@dataclass(frozen=True)
class DecodeSettings:
    """What resolve() decided for this run's transformers generation (config.DecodeConfig's `auto`s made concrete)."""

    loop: str          # 'lowvram' (this module's loop) | 'transformers' (transformers' generate, untouched)
    sampler: str       # one of SAMPLERS
    merge_lora: bool   # sampled tokens from the adapter merged into a copy of the 16-bit weights
    fused: bool = False  # sampled tokens through fused_decode.py's layers (merged, q/k/v and gate/up fused)

    def describe(self) -> str:
        if self.loop == "transformers":
            return "transformers' generate"
        return (f"own decode loop, {self.sampler.replace('_', '-')} sampler, "
                f"LoRA {'merged' if self.merge_lora else 'unmerged'} when sampling"
                + (", fused layers when sampling" if self.fused else ""))


# --------------------------------------------------------------------------- sampling

def filtered_scores(logits, temperature: float, top_k: int, top_p: float):
    """Float32 scores after transformers' warpers in its order (temperature, top-k, top-p), removed tokens at -inf:
    TemperatureLogitsWarper, TopKLogitsWarper (keep scores >= the k-th largest), TopPLogitsWarper (drop the
    ascending-sorted tokens whose cumulative probability is <= 1 - top_p, always keeping the most likely)."""
    import torch

    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores


def sample_inverse_cdf(scores, generator=None):
    """One token per row from softmax(scores): one uniform draw per row, inverted through the cumulative
    distribution (float64, so 49,152 additions round at ~1e-16, not float32's ~1e-7). `searchsorted(right=True)`
    returns the first token whose cumulative probability exceeds the draw: never a token of probability 0."""
    import torch

    cdf = scores.softmax(dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):  # NaN/inf logits (weights blown up): torch.multinomial's error, which
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")  # guards.explain reads
    draw = torch.rand((scores.shape[0], 1), dtype=torch.float64, device=scores.device, generator=generator)
    return torch.searchsorted(cdf, draw * total, right=True).clamp_(max=scores.shape[-1] - 1).squeeze(-1)


def sample_multinomial(scores, generator=None):
    """transformers' draw: torch.multinomial on the softmax."""
    import torch

    return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)


def next_tokens(logits, *, do_sample: bool, temperature: float, top_k: int, top_p: float, sampler: str,
                logprobs: Optional[list] = None):
    """Tokens [B] for logits [B, V]: argmax, or a draw from filtered_scores. `logprobs` (sampling only): a list that
    gets each drawn token's log-probability [B] under the distribution it was drawn from (float32 log_softmax of
    the scores after temperature, top-k and top-p: vLLM's processed_logprobs, which TRL's vLLM path asks for)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = filtered_scores(logits, temperature, top_k, top_p)
    tokens = (sample_inverse_cdf if sampler == "inverse_cdf" else sample_multinomial)(scores)
    if logprobs is not None:
        logprobs.append(scores.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
    return tokens


@contextlib.contextmanager
def sampler_logprobs(model):
    """Within: each sampled generate call our loop takes on `model` (install) appends, per new token, the drawn
    tokens' log-probs [B] (next_tokens' `logprobs`) to the yielded list; calls that go to transformers' generate
    add nothing (`loop_takes` says which beforehand)."""
    steps: list = []
    model._lowvram_logprobs = steps
    try:
        yield steps
    finally:
        model._lowvram_logprobs = None


# --------------------------------------------------------------------------- merged LoRA for sampling

def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def mergeable(model) -> Optional[str]:
    """Why the active adapter cannot be merged into a copy of the weights here, or None."""
    import torch

    layers = _lora_layers(model)
    if not layers:
        return "no LoRA layers"
    for layer in layers:
        weight = getattr(layer.get_base_layer(), "weight", None)
        if weight is None or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return "its base weights are quantized"
        if any(layer.use_dora.get(name) for name in layer.active_adapters if name in layer.use_dora):
            return "DoRA adapters are not merged here"
    return None


@contextlib.contextmanager
def merged_weights(model):
    """Within: every LoRA layer's base weight is a new tensor W + scale * B @ A of the active adapter(s) and the
    adapter layers are off, so a forward reads one weight per projection. After: the original weight tensors
    are put back untouched (never W + dBA - dBA, which would drift in 16-bit)."""
    import torch

    layers = [layer for layer in _lora_layers(model) if not layer.disable_adapters and layer.active_adapters]
    if not layers:
        yield
        return
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                original = base.weight.data
                delta = sum(layer.get_delta_weight(name).float() for name in layer.active_adapters if name in layer.lora_A)
                merged = (original.float() + delta).to(original.dtype)
                base.weight.data = merged
                swapped.append((layer, base, original))
                layer._disable_adapters = True  # peft's own flag, read by LoraLayer.forward
        yield
    finally:
        for layer, base, original in swapped:
            base.weight.data = original
            layer._disable_adapters = False


# --------------------------------------------------------------------------- the loop

def decode(model, input_ids, attention_mask, *, max_new_tokens: int, do_sample: bool, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, eos_token_ids=(), pad_token_id: Optional[int] = None,
           settings: DecodeSettings, fused: bool = False, logprobs: Optional[list] = None):
    """Prompt + new tokens, [batch, prompt + generated], as transformers' generate returns them: rows that ended
    (an eos token) continue with `pad_token_id`; the loop stops when every row ended or at max_new_tokens.
    `fused`: sampled tokens through fused_decode.py's layers (install decided the model is covered). `logprobs`:
    a list that gets, per new token, the sampled tokens' log-probs [B] (next_tokens). Every token
    our loop generates passes here (the OOM injector and the kit's capped run watch this function).

    Shapes: input_ids/attention_mask [B, P] left-padded; one prefill [B, P] -> logits [B, V] of the last
    position; then per token [B, 1] -> [B, V]."""
    import torch
    from transformers import DynamicCache

    from . import fused_decode

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def pick(logits):                                                                          # [B, V] -> [B]
        return next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                           sampler=settings.sampler, logprobs=logprobs)

    if fused and do_sample:
        return fused_decode.decode(inner, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                   eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, pick=pick)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = torch.cat([attention_mask, attention_mask.new_ones(batch, max_new_tokens)], dim=1)   # [B, P + N]
    positions = attention_mask.long().cumsum(-1) - 1                                          # [B, P]
    positions.masked_fill_(attention_mask == 0, 1)                                             # as transformers
    cache = DynamicCache(config=inner.config)
    out = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                use_cache=True, cache_position=torch.arange(prompt_len, device=device), logits_to_keep=1)

    def forward_next(token, last, step):
        out = inner(input_ids=token[:, None], attention_mask=mask[:, :prompt_len + step + 1], position_ids=last,
                    past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([prompt_len + step], device=device))
        return out.logits[:, -1]

    return fused_decode.token_loop(input_ids, positions[:, -1:], out.logits[:, -1], forward_next, pick,
                                   max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                   pad_token_id=pad_token_id)


# --------------------------------------------------------------------------- model.generate

UNSUPPORTED = {  # generation options this loop does not implement: such a call goes to transformers' generate
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "output_scores": False, "output_logits": False, "return_dict_in_generate": False,
    "output_attentions": False, "output_hidden_states": False, "penalty_alpha": None, "diversity_penalty": 0.0,
    "stop_strings": None, "guidance_scale": None, "sequence_bias": None, "encoder_repetition_penalty": 1.0,
    "exponential_decay_length_penalty": None, "renormalize_logits": False, "max_length": None,
    "remove_invalid_values": False, "encoder_no_repeat_ngram_size": 0, "use_cache": True,
}
_CALL_ONLY = ("input_ids", "attention_mask", "generation_config", "use_cache", "pad_token_id", "eos_token_id",
              "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "bos_token_id", "cache_implementation",
              "disable_compile")


def _plan(model, kwargs) -> Optional[dict]:
    """The loop's arguments for a generate(**kwargs) call, or None when it asks for something the loop lacks.
    The call's settings are read as transformers' generate reads them (its _prepare_generation_config: the call's
    config or kwargs, then the model's generation_config, then transformers' defaults, e.g. top_k 50 when unset)."""
    if any(key not in _CALL_ONLY for key in kwargs) or kwargs.get("input_ids") is None:
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "generation_config")}
    config, model_kwargs = inner._prepare_generation_config(kwargs.get("generation_config"), **extra)
    if set(model_kwargs) - {"use_cache"}:
        return None
    for key, neutral in UNSUPPORTED.items():
        value = getattr(config, key, neutral)
        if value is None or value == neutral or (key == "max_length" and config.max_new_tokens is not None):
            continue  # transformers: max_new_tokens wins over max_length
        return None
    if config.max_new_tokens is None:
        return None
    eos = config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    return dict(max_new_tokens=int(config.max_new_tokens), do_sample=bool(config.do_sample),
                temperature=float(config.temperature), top_k=int(config.top_k or 0), top_p=float(config.top_p),
                eos_token_ids=eos, pad_token_id=pad)


def loop_takes(model, kwargs: dict) -> bool:
    """Whether `model.generate(**kwargs)` runs our loop (install put it on this model and `_plan` covers the call),
    rather than transformers' generate."""
    return getattr(model, "_lowvram_decode", None) is not None and _plan(model, kwargs) is not None


def install(model, settings: DecodeSettings, log=None) -> None:
    """Make `model.generate` (a PEFT model) this module's loop for the calls it covers; idempotent.
    `model._lowvram_decode_calls` counts them (the tests check TRL's rollouts reach it). A model type outside
    `LOOP_TYPES` keeps transformers' generate, and asked-for fused layers the architecture lacks fall back to this
    loop on transformers' layers: each said once through `log`."""
    if settings.loop != "lowvram" or getattr(model, "_lowvram_decode", None) is not None:
        return
    import torch

    from . import fused_decode

    say = log or (lambda *_: None)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(inner.config, "model_type", None)
    if model_type not in LOOP_TYPES:
        say(f"decode.loop=lowvram: our decode loop is not checked equal to transformers' generate for model_type "
            f"{model_type} (checked: {', '.join(LOOP_TYPES)}): this model generates with transformers' generate")
        return
    plain = model.generate
    merge = settings.merge_lora and mergeable(model) is None
    why_not = fused_decode.unsupported(inner) if settings.fused and merge else None
    fused = settings.fused and merge and why_not is None
    if why_not is not None:
        say(f"decode.fused: the fused layers do not cover {why_not}: sampled tokens go through transformers' layers "
            "in our decode loop")

    @functools.wraps(plain)
    def generate(*args, **kwargs):
        plan = None if args else _plan(model, kwargs)
        if plan is None:
            return plain(*args, **kwargs)
        model._lowvram_decode_calls += 1
        was_training = model.training
        model.eval()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                if merge and plan["do_sample"] and not fused:
                    stack.enter_context(merged_weights(model))
                return decode(model, kwargs["input_ids"], kwargs.get("attention_mask"), settings=settings, fused=fused,
                              logprobs=getattr(model, "_lowvram_logprobs", None), **plan)
        finally:
            model.train(was_training)

    model._lowvram_decode = settings
    model._lowvram_decode_calls = 0
    model.generate = generate
