"""The transformers generation path at the machine's pace: one decode loop for the rollouts, priming's samples and
the held-out answers, wherever a model generates with transformers (the hf backend; not vLLM, not unsloth's own).

`install(model, settings)` (backends.load_model, after resolve() decided `settings`) makes the model's `generate`
this loop, so TRL's rollouts (TRL 1.15 calls the unwrapped model's `generate` with its GenerationConfig), our
evaluation and priming reach it with no change of theirs; a call with a setting outside LOOP_SETTINGS (beams, a
repetition penalty, min_p, top_h, max_time, logits processors, scores asked for, a key a newer transformers adds ...)
goes to transformers' own `generate`, unchanged, said once in the log.

The loop: one prefill of the left-padded prompts, then one forward per new token on the KV cache, as transformers'
`generate` does (the same position ids and attention mask, so greedy answers are identical to it,
tests/test_decoding.py; the lines it mirrors are read from the installed source by tests/test_decoding_contracts.py),
without its per-token machinery. Its levers, each one setting of `decode:`:

- `sampler`: 'inverse_cdf' draws one uniform number per row and inverts the cumulative distribution of the
  (temperature, top-k, top-p) probabilities; 'multinomial' is transformers' draw (torch.multinomial, which draws a
  full-vocabulary exponential per token; what each costs: docs/results.md, "Rollout speed").
  Same distribution, a different random stream (tests/test_decoding.py compares token frequencies).
- `merge_lora`: sampled tokens (rollouts, eval.samples) come from the adapter merged into a copy of the 16-bit
  weights, made once per call: one matmul per layer instead of three (the base's and LoRA's A and B) and no
  dropout/scale ops. The merge is PEFT's own get_delta_weight, for plain LoRA only (MERGE_OPTIONS, `mergeable`);
  other adapters are sampled unmerged (UNMERGED_OPTIONS) or generate with transformers' generate (`loop_refusal`);
  no tensor is written (a weight tied to another module keeps its values there), and a layer PEFT merged already is
  read as it is. Never into 4-bit weights (resolve refuses it); greedy answers always use the unmerged adapter,
  so the held-out columns are exactly those of the unmerged model. The merged copy holds the LoRA-targeted
  projections' weights once more while it generates (2 bytes a parameter in bf16).
- `fused`: sampled tokens through fused_decode.py's Llama-family layers (~30 ops a layer instead of transformers'
  ~500) where the architecture is covered and the adapter is plain LoRA; else the loop above. With `merge_lora`:
  the merged copies, q/k/v and gate/up each one matmul, reused by the next sampled calls while the adapter is
  unchanged (fused_decode.merged_copies: dynamic sampling's draws and a tool run's turns share one merge) and freed
  by the next training forward; without: the base weights read in place and the adapter added unmerged
  (fused_decode.UnmergedLinear: no copy of the weights).
- `weights` (opt-in, CPU): 'int8' multiplies the fused layers' base weights, quantized and packed once per model,
  with FBGEMM's dynamic int8 linear and adds the adapter unmerged (fused_decode.Int8Linear); where the fused layers do
  not run, sampled tokens read the model's own weights, said once in the log. 'bf16': the model's own weights (its
  dtype).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

from lowvram_grpo.model import fused_decode
from lowvram_grpo.core import internals
from lowvram_grpo.model.fused_decode import merged_weight
from lowvram_grpo.settings.plans import DecodeSettings  # noqa: F401  (what resolve decided)
from lowvram_grpo.settings.adapter_files import (  # noqa: F401  (the merge's options, read by tests as decoding.X)
    MERGE_OPTIONS,
    PLAIN_INITS,
    SET_DEFAULTS,
    UNMERGED_OPTIONS,
    options_beyond_merge,
)

SAMPLERS = ("inverse_cdf", "multinomial")
# The model types whose greedy answers from this loop are token for token those of transformers' generate, checked
# on a left-padded batch past the sliding window with a LoRA adapter (tests/test_families.py, tiny models of each,
# float32). Any other architecture keeps transformers' generate, said once in the run's log (`install`).
LOOP_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text", "gemma3_text", "gemma4_text", "gpt_oss", "smollm3")


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
    internals.set_mark(model, "logprobs", steps)
    try:
        yield steps
    finally:
        internals.set_mark(model, "logprobs", None)


# --------------------------------------------------------------------------- merged LoRA for sampling

def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _adapter_configs(model) -> dict:
    """{active adapter name: its LoraConfig as a dict} of a PEFT model."""
    configs = getattr(model, "peft_config", None) or {}
    names = getattr(model, "active_adapters", None) or []
    return {name: configs[name].to_dict() for name in names if name in configs}


def loop_refusal(model) -> Optional[str]:
    """Why our loop cannot decode this PEFT model at all (an active adapter with an option beyond MERGE_OPTIONS and
    UNMERGED_OPTIONS), or None."""
    for name, config in _adapter_configs(model).items():
        other = [key for key in options_beyond_merge(config) if key not in UNMERGED_OPTIONS]
        if other:
            return f"adapter {name!r} sets {', '.join(other)}"
    return None


def mergeable(model) -> Optional[str]:
    """Why the active adapter cannot be merged into a copy of the weights here, or None. Merged: only plain LoRA
    (MERGE_OPTIONS) on PEFT's lora.Linear over 16-bit or float32 weights; a layer PEFT already merged is read as
    it is (never merged twice)."""
    import torch
    from peft.tuners.lora.layer import Linear

    for name, config in _adapter_configs(model).items():
        beyond = options_beyond_merge(config)
        if beyond:
            return f"adapter {name!r} sets {', '.join(beyond)} (merged here: plain LoRA, rslora, alpha)"
    layers = _lora_layers(model)
    if not layers:
        return "no LoRA layers"
    for layer in layers:
        if type(layer) is not Linear:
            return f"LoRA on {type(layer).__module__}.{type(layer).__name__} layers (merged here: lora.Linear)"
        weight = getattr(layer.get_base_layer(), "weight", None)
        if weight is None or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return "its base weights are quantized"
        for name in layer.active_adapters:
            if name in getattr(layer, "lora_variant", {}):
                return f"a {type(layer.lora_variant[name]).__name__} adapter (merged here: plain LoRA)"
            if layer.lora_bias.get(name):
                return "lora_bias (merged here: plain LoRA)"
    return None


@contextlib.contextmanager
def merged_weights(model):
    """Within: every LoRA layer that PEFT has not merged reads a new weight tensor W + ΔW of its active adapter(s)
    (fused_decode.merged_weight: PEFT's get_delta_weight), held by a new Parameter set on the base layer, and its
    adapters are off (PEFT's `_disable_adapters`, read by LoraLayer.forward), so a forward reads one weight per
    projection; no tensor is written, so a weight tied to another module (lm_head and the input embeddings) keeps
    its values there. A layer PEFT merged already is left as it is (its forward reads W + ΔW). After, on any exit:
    the original Parameters are put back, the flags off again."""
    import torch


    layers = [layer for layer in _lora_layers(model)
              if not layer.disable_adapters and layer.active_adapters and not layer.merged]
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                original = base.weight
                base.weight = torch.nn.Parameter(merged_weight(layer), requires_grad=False)
                swapped.append((layer, base, original))
                internals.set_adapters_disabled(layer, True)  # read by LoraLayer.forward (tests/test_decoding.py)
        yield
    finally:
        for layer, base, original in swapped:
            base.weight = original
            internals.set_adapters_disabled(layer, False)


# --------------------------------------------------------------------------- the loop

# The model types whose prefill is shared by the rows of one prompt (DecodeSettings.shared_prefill): their cache is
# transformers' DynamicCache of full-attention layers, copied row by row with Cache.reorder_cache; checked on a tiny
# Llama (tests/test_shared_prompt.py). Others prefill every row.
SHARED_PREFILL_TYPES = ("llama",)


def shared_rows(input_ids, attention_mask):
    """(first [U], group [B]) when some rows of the left-padded prompts [B, P] are equal (tokens and mask): `first`,
    the row of each distinct prompt in order of appearance; `group`, the distinct prompt of each row. None when every
    row differs (nothing to share)."""
    import torch

    key = torch.cat([input_ids.masked_fill(attention_mask == 0, -1), attention_mask.long()], dim=1).tolist()
    seen, first, group = {}, [], []
    for row, values in enumerate(key):
        index = seen.setdefault(tuple(values), len(seen))
        if index == len(first):
            first.append(row)
        group.append(index)
    if len(first) == len(key):
        return None
    device = input_ids.device
    return torch.tensor(first, device=device), torch.tensor(group, device=device)


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


    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def pick(logits):                                                                          # [B, V] -> [B]
        return next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                           sampler=settings.sampler, logprobs=logprobs)

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    shared = shared_rows(input_ids, attention_mask) if settings.shared_prefill else None
    if shared is not None and getattr(inner.config, "model_type", None) not in SHARED_PREFILL_TYPES:
        shared = None
    if fused and do_sample:
        return fused_decode.decode(inner, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                   eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, pick=pick,
                                   weights=settings.weights, merged=settings.merge_lora, shared=shared)
    batch, prompt_len = input_ids.shape
    mask = torch.cat([attention_mask, attention_mask.new_ones(batch, max_new_tokens)], dim=1)   # [B, P + N]
    positions = fused_decode.prompt_positions(attention_mask)                                 # [B, P]
    cache = DynamicCache(config=inner.config)
    # transformers 5.17's models take no cache_position: the cache's own length places each step's keys
    if shared is None:
        out = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
    else:  # each distinct prompt prefilled once, its keys and values copied to the rows that share it
        first, group = shared
        out = inner(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=positions[first],
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.reorder_cache(group)
        logits = out.logits[:, -1][group]

    def forward_next(token, last, step):
        out = inner(input_ids=token[:, None], attention_mask=mask[:, :prompt_len + step + 1], position_ids=last,
                    past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    return fused_decode.token_loop(input_ids, positions[:, -1:], logits, forward_next, pick,
                                   max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                   pad_token_id=pad_token_id)


# --------------------------------------------------------------------------- model.generate

# GenerationConfig settings the loop implements, read as transformers' generate reads them
# (_prepare_generation_config); max_length only matters when max_new_tokens is unset, which the loop leaves to
# transformers
LOOP_SETTINGS = frozenset({"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
                           "eos_token_id", "pad_token_id", "bos_token_id"})
# settings that do not change which tokens come out: bookkeeping, and the cache and compilation of transformers'
# own loop (ours keeps its own cache)
NO_TOKEN_EFFECT = frozenset({"transformers_version", "_from_model_config", "use_cache", "cache_implementation",
                             "cache_config", "max_cache_len", "compile_config", "disable_compile"})


@functools.lru_cache(maxsize=1)
def _neutral_settings() -> dict:
    """Every setting of this transformers' GenerationConfig outside LOOP_SETTINGS and NO_TOKEN_EFFECT, at the value
    transformers' generate gives it when nobody sets it (GenerationConfig's own defaults, then its
    `_get_default_generation_params`): the loop runs only while each is there, so a key a newer transformers adds
    sends calls that set it to transformers' generate."""
    from transformers import GenerationConfig

    config = GenerationConfig()
    config.update(**internals.default_generation_params(config), defaults_only=True)
    return {key: value for key, value in _settings(config).items() if key not in LOOP_SETTINGS | NO_TOKEN_EFFECT}


def _settings(config) -> dict:
    """A GenerationConfig's settings, unset (None) ones included (its to_dict leaves those out)."""
    return {key: value for key, value in vars(config).items() if not key.startswith("_")}


def _off(value, neutral) -> bool:
    return value == neutral or (value in (None, False) and neutral in (None, False))


def _plan(model, kwargs) -> tuple[Optional[dict], str]:
    """(the loop's arguments for a generate(**kwargs) call, "") or (None, what the call asks for that the loop
    lacks). The call's settings are read as transformers' generate reads them (its _prepare_generation_config: the
    call's config or kwargs, then the model's generation_config, then transformers' defaults, e.g. top_k 50)."""
    if kwargs.get("input_ids") is None:
        return None, "a call without input_ids"
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "generation_config")}
    config, model_kwargs = internals.prepare_generation_config(inner, kwargs.get("generation_config"), **extra)
    others = sorted(set(model_kwargs) - {"use_cache"})
    if others:
        return None, ", ".join(others)
    neutral = _neutral_settings()
    values = _settings(config)
    for key in sorted(set(values) - LOOP_SETTINGS - NO_TOKEN_EFFECT):
        if not _off(values[key], neutral.get(key)):
            return None, f"{key}={values[key]!r}"
    if config.max_new_tokens is None:
        return None, "max_length without max_new_tokens"
    eos = config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    return dict(max_new_tokens=int(config.max_new_tokens), do_sample=bool(config.do_sample),
                temperature=float(config.temperature), top_k=int(config.top_k or 0), top_p=float(config.top_p),
                eos_token_ids=eos, pad_token_id=pad), ""


def loop_takes(model, kwargs: dict) -> bool:
    """Whether `model.generate(**kwargs)` runs our loop (install put it on this model and `_plan` covers the call),
    rather than transformers' generate."""
    return internals.mark(model, "decode") is not None and _plan(model, kwargs)[0] is not None


def install(model, settings: DecodeSettings, log=None) -> None:
    """Make `model.generate` (a PEFT model) this module's loop for the calls it covers; idempotent.
    `internals.mark(model, "decode_calls")` counts them (the tests check TRL's rollouts reach it). A model type outside
    `LOOP_TYPES`, or an adapter option beyond MERGE_OPTIONS and UNMERGED_OPTIONS, keeps transformers' generate; an
    adapter `mergeable` refuses is sampled unmerged; asked-for fused layers the architecture lacks fall back to this
    loop on transformers' layers; a call with a setting outside LOOP_SETTINGS goes to transformers' generate: each
    said once through `log`."""
    if settings.loop != "lowvram" or internals.mark(model, "decode") is not None:
        return
    import torch


    say = log or (lambda *_: None)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(inner.config, "model_type", None)
    if model_type not in LOOP_TYPES:
        say(f"decode.loop=lowvram: our decode loop is not checked equal to transformers' generate for model_type "
            f"{model_type} (checked: {', '.join(LOOP_TYPES)}): this model generates with transformers' generate")
        return
    refused = loop_refusal(model)
    if refused is not None:
        say(f"decode.loop=lowvram: {refused}, which our decode loop does not implement: this model generates with "
            "transformers' generate (through PEFT's)")
        return
    plain = model.generate
    why_unmerged = mergeable(model) if settings.merge_lora or settings.fused else None  # not plain LoRA
    if why_unmerged not in (None, "no LoRA layers"):
        say(f"decode.merge_lora: {why_unmerged}: sampled tokens come from the unmerged adapter (PEFT's forward)")
    merge = settings.merge_lora and why_unmerged is None
    plain_lora = why_unmerged is None           # what the fused layers' merged or unmerged arithmetic reproduces
    why_not = fused_decode.unsupported(inner) if settings.fused and plain_lora else None
    fused = settings.fused and plain_lora and why_not is None
    if why_not is not None:
        say(f"decode.fused: the fused layers do not cover {why_not}: sampled tokens go through transformers' layers "
            "in our decode loop")
    if settings.weights == "int8" and not fused:
        say(f"decode.weights=int8: the fused layers do not run for this model "
            f"({why_not or why_unmerged or 'the adapter is not merged'}): sampled tokens read the model's own "
            f"{str(inner.dtype).removeprefix('torch.')} weights")
    said = set()

    @functools.wraps(plain)
    def generate(*args, **kwargs):
        plan, why = (None, "positional arguments") if args else _plan(model, kwargs)
        if plan is None:
            if why not in said:
                said.add(why)
                say(f"decode.loop=lowvram: a generate call with {why}, which our decode loop does not implement, "
                    "goes to transformers' generate")
            return plain(*args, **kwargs)
        internals.set_mark(model, "decode_calls", internals.mark(model, "decode_calls") + 1)
        was_training = model.training
        model.eval()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                if merge and plan["do_sample"] and not fused:
                    stack.enter_context(merged_weights(model))
                return decode(model, kwargs["input_ids"], kwargs.get("attention_mask"), settings=settings, fused=fused,
                              logprobs=internals.mark(model, "logprobs"), **plan)
        finally:
            model.train(was_training)

    internals.set_mark(model, "decode", settings)
    internals.set_mark(model, "decode_calls", 0)
    internals.replace_generate(model, generate)
