"""Our decode loop (decoding.py) against transformers' generate, on the real models: greedy answers identical
(token for token, with and without an adapter, on SmolLM2's held-out questions), sampled tokens from the same
distribution (token frequencies at temperature 1, fixed seeds), the filters equal to transformers' warpers, the
merged weights put back untouched, calls it does not cover left to transformers, and TRL's rollouts reaching it."""
import pytest
import torch
from conftest import load_handle, perturb_adapter

from lowvram_grpo.model import decoding
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve


_handle = load_handle
_perturb_adapter = perturb_adapter


def _plain_generate(model, **kwargs):
    """transformers' own generate on the same model object (the class's method, not the installed loop), in eval
    mode as TransformersEngine and TRL generate (in train mode with checkpointing, transformers drops the cache)."""
    was_training = model.training
    model.eval()
    try:
        return type(model).generate(model, **kwargs)
    finally:
        model.train(was_training)


def _encode(tokenizer, texts):
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


# --------------------------------------------------------------------------- the levers as resolved

def test_resolve_decides_the_levers_per_device_and_refuses_what_cannot_hold():
    from lowvram_grpo.core.errors import ResolveError
    from lowvram_grpo.settings.hardware import profile

    cpu = resolve(load_config("smollm2_cpu", []), detect(), "hf")
    assert (cpu.decode_loop, cpu.decode_sampler, cpu.decode_merge_lora, cpu.decode_fused) == (
        "lowvram", "inverse_cdf", True, True)
    assert ("own decode loop, inverse-cdf sampler, LoRA merged when sampling, fused layers when sampling"
            in cpu.describe())
    plain = resolve(load_config("smollm2_cpu", ["decode.loop=transformers"]), detect(), "hf")
    assert (plain.decode_loop, plain.decode_merge_lora) == ("transformers", False)
    four_bit = resolve(load_config("smollm2_cpu", ["memory.load_in_4bit=true"]), detect(), "hf")
    assert four_bit.decode_loop == "lowvram" and not four_bit.decode_merge_lora  # never merged into 4-bit
    assert not four_bit.decode_fused
    with pytest.raises(ResolveError, match="decode.fused=true reads 16-bit base weights and memory.load_in_4bit is on"):
        resolve(load_config("smollm2_cpu", ["memory.load_in_4bit=true", "decode.fused=true"]), detect(), "hf")
    unmerged = resolve(load_config("smollm2_cpu", ["decode.merge_lora=false"]), detect(), "hf")
    assert (unmerged.decode_merge_lora, unmerged.decode_fused) == (False, True)  # fused, the adapter unmerged
    assert "LoRA unmerged when sampling, fused layers when sampling" in unmerged.describe()
    with pytest.raises(ResolveError, match="never merged into 4-bit"):
        resolve(load_config("smollm2_cpu", ["memory.load_in_4bit=true", "decode.merge_lora=true"]), detect(), "hf")
    gpu = resolve(load_config("qwen1_5b_4bit", []), profile("t4"), "hf")
    assert gpu.decode_loop == "transformers" and not gpu.decode_merge_lora  # CUDA: not measured yet
    with pytest.raises(ResolveError, match="decode.loop=lowvram"):
        resolve(load_config("qwen1_5b_4bit", ["decode.loop=lowvram"]), profile("t4"), "unsloth")


# --------------------------------------------------------------------------- sampling

def test_filters_equal_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper, TemperatureLogitsWarper

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 500, generator=generator) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.0, 0, 0.9), (1.3, 25, 0.8), (1.0, 1, 0.5)]:
        expected = logits.clone()
        if temperature != 1.0:
            expected = TemperatureLogitsWarper(temperature)(None, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(decoding.filtered_scores(logits, temperature, top_k, top_p), expected)


def _chi2_sf(stat: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom >= stat): the regularized upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _chi_square_p(observed: list[float], expected: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return _chi2_sf(stat, len(observed) - 1)


def _two_sample_p(a: list[float], b: list[float]) -> float:
    """Chi-square test of homogeneity of two frequency tables over the same bins."""
    total_a, total_b = sum(a), sum(b)
    stat = 0.0
    for x, y in zip(a, b):
        column = x + y
        for observed, total in ((x, total_a), (y, total_b)):
            expected = column * total / (total_a + total_b)
            stat += (observed - expected) ** 2 / expected
    return _chi2_sf(stat, len(a) - 1)


def test_inverse_cdf_draws_the_softmax_distribution():
    """5,000 draws from a peaked 49,152-token distribution (SmolLM2's vocabulary size): frequencies fit the
    probabilities (chi-square over the tokens expected >= 5 times, the rest pooled), and never a removed token."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 49152, generator=generator) * 4
    logits[0, :6] += 12  # a few likely tokens, a long tail
    probs = logits.softmax(-1)[0].double()
    torch.manual_seed(2)
    draws = decoding.sample_inverse_cdf(logits.expand(5000, -1).contiguous())  # 20,000: ~8 GB of float64 CDF
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs * len(draws)
    big = expected >= 5
    observed = counts[big].tolist() + [counts[~big].sum().item()]
    wanted = expected[big].tolist() + [expected[~big].sum().item()]
    assert _chi_square_p(observed, wanted) > 1e-3
    filtered = decoding.filtered_scores(logits, 1.0, 3, 1.0)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    assert set(decoding.sample_inverse_cdf(filtered.expand(2000, -1).contiguous()).tolist()) == top3


# --------------------------------------------------------------------------- the loop on the real models

@pytest.fixture(scope="module")
def smollm2():
    handle = _handle("smollm2_cpu")
    assert handle.model._lowvram_decode == handle.resolved.decode  # installed by load_model
    return handle


def _held_out_prompts(handle, n: int, preset: str = "smollm2_cpu"):
    """The preset's first `n` held-out questions as chat-templated prompt texts (the run's data settings are the
    user's config, read here as the pipeline reads them; the handle carries the plan only)."""
    from lowvram_grpo.task.data import load_questions, to_prompt_rows

    config = load_config(preset)
    _, held_out = load_questions(config.data)
    rows = to_prompt_rows(held_out[:n], config.data.system_prompt)
    return [handle.tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]


@pytest.mark.slow
def test_greedy_answers_are_token_for_token_those_of_transformers_generate(smollm2):
    """The preset's first 32 held-out questions in one batch of 32 (eval.batch_size), the adapter off (the 'before'
    column) and on (a perturbed adapter, as after training), up to the preset's 64 new tokens (what its evaluation
    and rollouts generate): identical token ids, to the last pad. (64 questions up to 128 tokens took 432 s of a
    two-worker CI run on an AVX2-only EPYC, 32 up to 128 tokens 315 s; one batch of the eval's shows the same.)"""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    texts = _held_out_prompts(smollm2, 32)
    kwargs = dict(max_new_tokens=smollm2.plan.train.max_completion_length, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id, use_cache=True)
    _perturb_adapter(model, 0.02)
    calls = model._lowvram_decode_calls
    for adapter in (False, True):
        for start in range(0, len(texts), 32):
            batch = _encode(tokenizer, texts[start:start + 32])
            with torch.no_grad(), (model.disable_adapter() if not adapter else torch.enable_grad()):
                ours = model.generate(**batch, **kwargs)
                theirs = _plain_generate(model, **batch, **kwargs)
            assert torch.equal(ours, theirs), f"adapter {adapter}, batch at {start}"
    assert model._lowvram_decode_calls == calls + 2
    _perturb_adapter(model, 0.0)


def _fit_p(drawn: list[int], probs) -> float:
    """Chi-square goodness of fit of the tokens `drawn` to the distribution `probs` [V], over the tokens expected >= 5
    times, the rest pooled."""
    counts = torch.bincount(torch.tensor(drawn), minlength=probs.numel()).double()
    expected = probs * len(drawn)
    big = expected >= 5
    assert int(big.sum()) >= 3, "a distribution worth comparing: three tokens expected >= 5 times"
    return _chi_square_p(counts[big].tolist() + [counts[~big].sum().item()],
                         expected[big].tolist() + [expected[~big].sum().item()])


@pytest.mark.slow
def test_sampled_first_tokens_have_transformers_distribution_merged_or_not(smollm2):
    """256 first tokens of one held-out prompt at temperature 1 from our loop (inverse-CDF draw, the adapter merged,
    fused layers: the default here) fit the distribution transformers' generate samples from for the same prompt
    (its scores, the adapter on and unmerged, softmaxed: the exact distribution, not a second sample), and the same
    draws do not fit the base model's (adapter off): the adapter (B at scale 0.1, total variation ~0.4 from the base
    here) is what the test sees. At B's scale 0.02 the two differ by ~0.06, which 512 draws cannot tell apart."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    assert smollm2.resolved.decode_merge_lora and smollm2.resolved.decode_fused
    prompt = _held_out_prompts(smollm2, 1)
    one, batch = _encode(tokenizer, prompt), _encode(tokenizer, prompt * 128)
    kwargs = dict(max_new_tokens=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  pad_token_id=tokenizer.pad_token_id)
    calls = model._lowvram_decode_calls
    _perturb_adapter(model, 0.1, seed=3)
    try:
        with torch.no_grad():
            def exact():                                                     # transformers' sampling distribution [V]
                out = _plain_generate(model, **one, **kwargs, output_scores=True, return_dict_in_generate=True)
                return out.scores[0][0].double().softmax(-1)

            adapter = exact()
            with model.disable_adapter():
                base = exact()
            torch.manual_seed(11)
            drawn = []
            for _ in range(2):
                drawn += model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1]].tolist()
        assert model._lowvram_decode_calls == calls + 2  # the draws were our loop's, not transformers'
        assert _fit_p(drawn, adapter) > 1e-3
        assert _fit_p(drawn, base) < 1e-3
    finally:
        _perturb_adapter(model, 0.0)


def test_merged_weights_are_the_adapters_and_are_put_back_untouched(tiny_model_dir):
    handle = _handle("tiny", ["decode.merge_lora=true"])
    model = handle.model
    _perturb_adapter(model, 0.05)
    layers = decoding._lora_layers(model)
    originals = [layer.get_base_layer().weight.data for layer in layers]
    copies = [w.clone() for w in originals]
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        with decoding.merged_weights(model):
            merged = model(input_ids=ids).logits
            assert all(layer.get_base_layer().weight.data_ptr() != w.data_ptr() for layer, w in zip(layers, originals))
        after = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    tolerance = 1e-4 if originals[0].dtype == torch.float32 else 5e-2
    assert torch.allclose(merged, unmerged, atol=tolerance, rtol=0)
    assert not torch.allclose(base, unmerged, atol=10 * tolerance, rtol=0)  # the adapter matters
    assert all(layer.get_base_layer().weight.data_ptr() == w.data_ptr() for layer, w in zip(layers, originals))
    assert all(torch.equal(w, c) for w, c in zip(originals, copies))
    assert torch.equal(after, unmerged)


def test_calls_it_does_not_cover_go_to_transformers(tiny_model_dir):
    handle = _handle("tiny")
    model, tokenizer = handle.model, handle.tokenizer
    batch = _encode(tokenizer, ["a b c", "d e"])
    before = model._lowvram_decode_calls
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
        model.generate(**batch, max_new_tokens=3, do_sample=True, min_p=0.1)
        model.generate(**batch, max_new_tokens=3, num_beams=2)
        assert model._lowvram_decode_calls == before
        model.generate(**batch, max_new_tokens=3, do_sample=True, top_k=5)
    assert model._lowvram_decode_calls == before + 1


def test_rows_that_ended_are_padded_and_the_loop_stops_when_all_ended(tiny_model_dir):
    """Every token an end of sequence: each row has one new token, then nothing (the loop stops at once),
    as transformers stops; with an eos that never comes, max_new_tokens tokens."""
    handle = _handle("tiny")
    model, tokenizer = handle.model, handle.tokenizer
    batch = _encode(tokenizer, ["a b c", "d e"])
    vocab = model.get_base_model().config.vocab_size
    with torch.no_grad():
        first = _plain_generate(model, **batch, max_new_tokens=1, do_sample=False)[:, -1].tolist()
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, eos_token_id=first, pad_token_id=0)
        assert out.shape[1] == batch["input_ids"].shape[1] + 1
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, eos_token_id=vocab + 5, pad_token_id=0)
        theirs = _plain_generate(model, **batch, max_new_tokens=6, do_sample=False, eos_token_id=vocab + 5,
                                 pad_token_id=0)
    assert out.shape[1] == batch["input_ids"].shape[1] + 6 and torch.equal(out, theirs)


@pytest.mark.slow
def test_trls_rollouts_reach_the_loop_in_a_real_run(tmp_path, tiny_model_dir):
    """A real tiny GRPO run (TRL's own generation path, no vLLM): its rollouts come from our loop, sampled from the
    merged adapter; with decode.loop=transformers, none do."""
    from lowvram_grpo.run.pipeline import run

    counts = {}
    for loop in ("auto", "transformers"):
        config = load_config("tiny", ["train.max_steps=2", "eval.enabled=false", f"decode.loop={loop}",
                                      "decode.merge_lora=true"][: 3 if loop == "transformers" else 4])
        result = run(config, tmp_path / loop, backend="hf", log=lambda *_: None)
        counts[loop] = getattr(result.handle.model, "_lowvram_decode_calls", None)
    assert counts["auto"] >= 2 and counts["transformers"] is None, counts



# --------------------------------------------------------------------------- the fused layers (fused_decode.py)

def _peft_tiny(kind: str):
    """A small random float32 model of `kind` with LoRA on all seven projections, B perturbed (a trained adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=256)
    if kind == "qwen2":
        base = Qwen2ForCausalLM(Qwen2Config(**shape))
    elif kind == "qwen3":  # q/k norms, with weights away from 1 so a missing norm shows
        base = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))
        with torch.no_grad():
            for layer in base.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    else:
        base = LlamaForCausalLM(LlamaConfig(**shape, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                   "original_max_position_embeddings": 64}))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    _perturb_adapter(model, 0.1)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("merged", [True, False])
def test_fused_layers_compute_transformers_logits_with_the_adapter(kind, merged):
    """float32, a left-padded batch: the fused layers' logits (the adapter merged into copies, or unmerged on the
    base weights) after the prefill and after each new token equal transformers' forward of the PEFT model (adapter
    unmerged, its own KV cache) to float32 rounding, and the greedy tokens are the same; for qwen2 with its q/k/v
    biases, for llama with llama3 RoPE scaling, for qwen3 with its per-head q/k RMSNorms."""
    from lowvram_grpo.model import fused_decode

    model = _peft_tiny(kind)
    inner = model.get_base_model()
    assert fused_decode.unsupported(inner) is None
    ids = torch.tensor([[0, 0, 5, 9, 14, 3], [7, 1, 8, 2, 9, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    seen = []

    def pick(logits):
        seen.append(logits)
        return logits.argmax(-1)

    with torch.no_grad():
        ours = fused_decode.decode(inner, ids, mask, max_new_tokens=5, eos_token_ids=[], pad_token_id=0, pick=pick,
                                   merged=merged)
        theirs = _plain_generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert torch.equal(ours, theirs)
        for step, logits in enumerate(seen):
            width = ids.shape[1] + step
            full = torch.cat([mask, mask.new_ones(2, step)], 1)
            positions = (full.cumsum(-1) - 1).clamp(min=0)
            reference = model(input_ids=ours[:, :width], attention_mask=full, position_ids=positions).logits[:, -1]
            assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4), (step, (logits - reference).abs().max())


def test_fused_layers_refuse_what_they_do_not_cover():
    from lowvram_grpo.model import fused_decode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50, use_sliding_window=True, sliding_window=8)
    assert "sliding" in fused_decode.unsupported(Qwen2ForCausalLM(config))
    from transformers import GPT2Config, GPT2LMHeadModel

    assert "model_type gpt2" in fused_decode.unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


# --------------------------------------------------------------------------- bf16, every RoPE type, ties, biases

ROPE_TYPES = {  # each RoPE type transformers' rotary module gives these families (fused_decode runs any of them)
    "default": None, "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # max_position_embeddings 16: grows past it while decoding
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
_IDS = torch.tensor([[0, 0, 5, 9, 14, 3], [7, 1, 8, 2, 9, 4]])
_MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_peft(kind: str, *, dtype=torch.bfloat16, rope: str = "default", targets=tuple(_ALL), scale: float = 0.3,
               init: float = 0.02, **lora):
    """A random 2-layer `kind` model with tied embeddings (and attention biases: qwen2's own, llama's
    attention_bias), random non-zero biases, weights drawn at std `init`, in `dtype`, LoRA on `targets` with B drawn
    at `scale` (trained-looking)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, tie_word_embeddings=True, initializer_range=init,
                 max_position_embeddings=16 if rope == "dynamic" else 64)
    if ROPE_TYPES[rope]:
        shape["rope_scaling"] = dict(ROPE_TYPES[rope])
    config_class, model_class, extra = {"llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True)),
                                        "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
                                        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {})}[kind]
    base = model_class(config_class(**shape, **extra))
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    base = base.to(dtype)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **lora))
    _perturb_adapter(model, scale, seed=1)
    return model.eval()


def _greedy(model, **kwargs):
    return _plain_generate(model, input_ids=_IDS, attention_mask=_MASK, max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind, rope", [(k, r) for k in ("llama", "mistral", "qwen2") for r in ROPE_TYPES])
def test_bf16_sixteen_greedy_tokens_equal_transformers_on_each_rope_type(kind, rope):
    """bf16 weights, tied embeddings, biases, a left-padded batch, 16 greedy tokens: our loop on transformers' layers
    (adapter unmerged) gives transformers' generate's tokens, and the fused layers (adapter merged by PEFT's
    get_delta_weight, rounded once to bf16) give those of transformers' generate on the model PEFT merged itself
    (the same bf16 weights: W + ΔW rounded once). Unmerged (the base weights read in place, the adapter added as
    PEFT's forward adds it), fed transformers' greedy tokens, their log-probs stay as near PEFT's unmerged forward as
    the merged layers' do (within 1.5x and 0.005 nats: bf16 rounding of other ops, not token for token). The
    adapter matters: without it the tokens differ."""
    from lowvram_grpo.model import fused_decode

    model = _tiny_peft(kind, rope=rope)
    inner = model.get_base_model()
    assert fused_decode.unsupported(inner) is None
    settings = decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True)
    with torch.no_grad():
        theirs = _greedy(model)
        ours = decoding.decode(model, _IDS, _MASK, max_new_tokens=16, do_sample=False, eos_token_ids=[],
                               pad_token_id=0, settings=settings)
        assert torch.equal(ours, theirs)
        gap = {merged: _forced_gap(model, theirs, merged) for merged in (True, False)}
        assert gap[False] <= 1.5 * gap[True] + 0.005, gap
        fused = fused_decode.decode(inner, _IDS, _MASK, max_new_tokens=16, eos_token_ids=[], pad_token_id=0,
                                    pick=lambda logits: logits.argmax(-1))
        model.merge_adapter()
        try:
            merged_theirs = _greedy(model)
        finally:
            model.unmerge_adapter()
        assert torch.equal(fused, merged_theirs)
        with model.disable_adapter():
            assert not torch.equal(_greedy(model), theirs)


def _forced_logits(model, tokens, merged: bool) -> list:
    """The fused layers' (`merged` or not) logits [B, V] at each step, fed `tokens` [B, P + N] (_IDS's prompt)."""
    from lowvram_grpo.model import fused_decode

    forced, seen = tokens[:, _IDS.shape[1]:], []

    def pick(logits):
        seen.append(logits.float())
        return forced[:, len(seen) - 1]

    with torch.no_grad():
        fused_decode.decode(model.get_base_model(), _IDS, _MASK, max_new_tokens=forced.shape[1], eos_token_ids=[],
                            pad_token_id=0, pick=pick, merged=merged)
    return seen


def _largest_logp_gap(ours: list, theirs: list) -> float:
    return max(float((a.float().log_softmax(-1) - b.float().log_softmax(-1)).abs().max()) for a, b in zip(ours, theirs))


def _forced_gap(model, tokens, merged: bool) -> float:
    """The largest |log-prob| difference, over every step and token, between the fused layers (`merged` or not)
    fed `tokens` [B, P + N] and PEFT's forward as the model stands (what the trainer scores with)."""
    return _largest_logp_gap(_forced_logits(model, tokens, merged), _reference_logits(model, tokens[:, :-1]))


def test_unmerged_fused_layers_read_the_base_weights_in_place_and_the_adapter_counts():
    """bf16, a trained-looking adapter: the unmerged fused layers multiply with the base weights themselves (the
    very tensors of the model: nothing copied for sampling; the tied head without LoRA is the embeddings' tensor), and
    the adapter is in what they compute: fed one sequence, their log-probs are near PEFT's forward with the adapter
    and far from it without."""
    from lowvram_grpo.model import fused_decode

    model = _tiny_peft("llama")
    inner = model.get_base_model()
    layers = fused_decode.FusedLayers(inner, 2, 8, merged=False)
    read = {weight.data_ptr() for layer in layers.layers for name in ("qkv", "o", "gate_up", "down")
            for weight, _ in layer[name][0].bases}
    assert read == {layer.get_base_layer().weight.data_ptr() for layer in decoding._lora_layers(model)}
    assert layers.head[0].bases[0][0].data_ptr() == inner.lm_head.weight.data_ptr() and layers.head[0].lora is None
    with torch.no_grad():
        tokens = _greedy(model)
    ours = _forced_logits(model, tokens, merged=False)
    near = _largest_logp_gap(ours, _reference_logits(model, tokens[:, :-1]))
    with model.disable_adapter():
        far = _largest_logp_gap(ours, _reference_logits(model, tokens[:, :-1]))
    assert near < 0.05 < far, (near, far)


# --------------------------------------------------------------------------- the adapter in the sampled tokens

@pytest.mark.parametrize("merge", [True, False])
def test_the_adapter_really_shifts_the_sampled_distribution(merge):
    """Our installed generate (fused; merged: the CPU default, or unmerged) at temperature 1, 2,048 first tokens of
    one prompt: with the adapter their frequencies differ from those without it (two-sample chi-square p < 1e-6) and
    agree with transformers' generate on the unmerged adapter (p > 1e-3)."""
    model = _tiny_peft("llama", init=0.3)  # logits far from uniform
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=merge,
                                                    fused=True))
    prompt = torch.tensor([[5, 9, 14, 3]]).expand(2048, -1).contiguous()
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=True,
                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(5)
    with torch.no_grad():
        with_adapter = model.generate(**kwargs)[:, -1].tolist()
        with model.disable_adapter():
            without = model.generate(**kwargs)[:, -1].tolist()
        reference = _plain_generate(model, **kwargs)[:, -1].tolist()
    assert model._lowvram_decode_calls == 2

    def table(a, b):
        tokens = sorted(set(a) | set(b))
        frequent = [t for t in tokens if a.count(t) + b.count(t) >= 20]
        return [[x.count(t) for t in frequent] + [sum(x.count(t) for t in tokens if t not in frequent)] for x in (a, b)]

    assert _two_sample_p(*table(with_adapter, without)) < 1e-6
    assert _two_sample_p(*table(with_adapter, reference)) > 1e-3


# --------------------------------------------------------------------------- a failure mid-loop

def _snapshot(model):
    return {name: (tensor.data_ptr(), tensor.detach().clone())
            for name, tensor in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("fused, merge", [(False, True), (True, True), (True, False)])
def test_an_exception_mid_loop_leaves_the_model_exactly_as_it_was(fused, merge):
    """A forward that raises at the third token step (in a decoder layer on transformers' layers, in the rotary
    module on the fused ones, where each path computes), while sampling from the merged adapter: the error reaches
    the caller; every parameter and buffer is the same tensor with the same bytes, no LoRA layer is merged or left
    off, the model is back in train mode, its generate is still our loop, and the next call samples what a call on
    the untouched model samples."""
    model = _tiny_peft("qwen2", dtype=torch.bfloat16)
    model.train()
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=merge,
                                                    fused=fused))
    installed = model.generate
    before = _snapshot(model)
    kwargs = dict(input_ids=_IDS, attention_mask=_MASK, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0,
                  eos_token_id=None)
    torch.manual_seed(3)
    expected = model.generate(**kwargs)
    body = model.get_base_model().model
    watched = body.rotary_emb if fused else body.layers[1]
    calls = []

    def fail(*_):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected in the loop")

    handle = watched.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected in the loop"):
            model.generate(**kwargs)
    finally:
        handle.remove()
    assert len(calls) == 3
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, (pointer, values) in before.items():
        assert after[name][0] == pointer and torch.equal(after[name][1], values), name
    layers = decoding._lora_layers(model)
    assert layers and not any(layer.merged or layer.disable_adapters for layer in layers)
    assert model.training and model.generate is installed
    torch.manual_seed(3)
    assert torch.equal(model.generate(**kwargs), expected)


# --------------------------------------------------------------------------- merges refused or decoded right

def _recorded_logits(model, *, fused: bool, steps: int = 4, merged: bool = True):
    """The logits [B, V] our loop samples from at each step, sampling from the merged adapter (fused layers, or
    merged_weights on transformers' layers; with `fused` and not `merged`: the fused layers' unmerged adapter), with
    greedy picks so both sides follow one sequence."""
    from lowvram_grpo.model import fused_decode

    seen = []

    def pick(logits):
        seen.append(logits.float())
        return logits.argmax(-1)

    inner = model.get_base_model()
    with torch.no_grad():
        if fused:
            out = fused_decode.decode(inner, _IDS, _MASK, max_new_tokens=steps, eos_token_ids=[], pad_token_id=0,
                                      pick=pick, merged=merged)
        else:
            original = decoding.next_tokens
            decoding.next_tokens = lambda logits, **_: pick(logits)  # the loop's own pick, recording
            try:
                with decoding.merged_weights(model):
                    settings = decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True)
                    out = decoding.decode(model, _IDS, _MASK, max_new_tokens=steps, do_sample=True, eos_token_ids=[],
                                          pad_token_id=0, settings=settings)
            finally:
                decoding.next_tokens = original
    return out, seen


def _reference_logits(model, out):
    """transformers' forward of the PEFT model as it stands (adapter unmerged, or as PEFT merged it) at each step
    of `out`."""
    reference = []
    with torch.no_grad():
        for step in range(out.shape[1] - _IDS.shape[1]):
            width = _IDS.shape[1] + step
            full = torch.cat([_MASK, _MASK.new_ones(2, step)], 1)
            positions = (full.cumsum(-1) - 1).clamp(min=0)
            reference.append(model(input_ids=out[:, :width], attention_mask=full, position_ids=positions).logits[:, -1])
    return reference


@pytest.mark.parametrize("fused, merged", [(False, True), (True, True), (True, False)])
def test_lora_on_the_lm_head_of_a_tied_model_is_sampled_right_and_leaves_the_embeddings(fused, merged):
    """Tied embeddings, LoRA on lm_head and every projection (float32, so rounding stays below 1e-4): the logits
    our loop samples from are those of PEFT's unmerged forward at every step, and the input embeddings (the tensor
    lm_head shares) keep their bytes throughout: no merge writes through a tied weight."""
    model = _tiny_peft("llama", dtype=torch.float32, targets=_ALL + ["lm_head"])
    embeddings = model.get_base_model().model.embed_tokens.weight
    copy = embeddings.detach().clone()
    assert decoding.mergeable(model) is None
    out, seen = _recorded_logits(model, fused=fused, merged=merged)
    assert torch.equal(embeddings, copy) and model.get_base_model().lm_head.base_layer.weight is embeddings
    for step, (ours, theirs) in enumerate(zip(seen, _reference_logits(model, out))):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (step, (ours - theirs).abs().max())
    with torch.no_grad(), model.disable_adapter():  # the adapter matters
        base = _reference_logits(model, out)
    assert all((ours - theirs).abs().max() > 1e-2 for ours, theirs in zip(seen, base))


@pytest.mark.parametrize("fused, merged", [(False, True), (True, True), (True, False)])
def test_an_adapter_peft_already_merged_is_never_merged_twice(fused, merged):
    """PEFT's merge_adapter (its `merged` flag): our sampled path reads the merged weights as they are: its logits
    are PEFT's forward of the merged model at every step, the layers stay merged, their weights keep their bytes."""
    model = _tiny_peft("qwen2", dtype=torch.float32)
    model.merge_adapter()
    layers = decoding._lora_layers(model)
    assert all(layer.merged for layer in layers)
    before = _snapshot(model)
    out, seen = _recorded_logits(model, fused=fused, merged=merged)
    assert all(layer.merged and not layer.disable_adapters for layer in layers)
    assert all(torch.equal(_snapshot(model)[name][1], values) for name, (_, values) in before.items())
    for step, (ours, theirs) in enumerate(zip(seen, _reference_logits(model, out))):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (step, (ours - theirs).abs().max())


def test_a_lora_bias_adapter_is_sampled_unmerged_and_exactly():
    """lora_bias (a bias on B, outside plain LoRA): `mergeable` refuses it, install says so once and samples from
    PEFT's unmerged forward on transformers' layers; with the multinomial sampler and one seed, the sampled tokens are
    transformers' generate's, token for token."""
    model = _tiny_peft("qwen2", targets=["q_proj", "k_proj", "v_proj"], lora_bias=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and name.endswith("bias"):
                param.normal_(0, 0.5)
    assert "lora_bias" in decoding.mergeable(model)
    said = []
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="multinomial", merge_lora=True,
                                                    fused=True), log=said.append)
    assert any("decode.merge_lora: adapter 'default' sets lora_bias" in line for line in said), said
    kwargs = dict(input_ids=_IDS, attention_mask=_MASK, max_new_tokens=12, do_sample=True, top_k=0, top_p=1.0,
                  temperature=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        torch.manual_seed(8)
        ours = model.generate(**kwargs)
        torch.manual_seed(8)
        theirs = _plain_generate(model, **kwargs)
    assert model._lowvram_decode_calls == 1 and torch.equal(ours, theirs)


def test_an_init_adapter_with_an_option_beyond_the_merge_is_refused_when_the_merge_is_asked_for(tmp_path,
                                                                                                   tiny_model_dir):
    """A saved adapter whose adapter_config.json sets lora_bias (or an aLoRA's invocation tokens): with
    decode.merge_lora=true, refused at the settings check (before the model loads) in one line; with auto, accepted."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lowvram_grpo.settings.checks import before_load
    from lowvram_grpo.core.errors import ConfigError

    folder = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                   LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    raw = json.loads((folder / "adapter_config.json").read_text())
    before_load(load_config("tiny", [f"lora.init_adapter={folder}", "decode.merge_lora=true"]))  # plain LoRA
    for option, value in (("lora_bias", True), ("alora_invocation_tokens", [5, 6])):
        (folder / "adapter_config.json").write_text(json.dumps({**raw, option: value}))
        with pytest.raises(ConfigError, match=f"sets {option} in its adapter_config.json, which decode.merge_lora=true "
                                              "cannot merge"):
            before_load(load_config("tiny", [f"lora.init_adapter={folder}", "decode.merge_lora=true"]))
        before_load(load_config("tiny", [f"lora.init_adapter={folder}"]))


def test_an_adapter_whose_variant_needs_peft_generate_keeps_transformers_generate():
    """aLoRA (its invocation offsets come from PEFT's generate): our loop does not run; said once."""
    model = _tiny_peft("llama", dtype=torch.float32, targets=["q_proj", "v_proj"], alora_invocation_tokens=[7])
    said = []
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True),
                     log=said.append)
    assert getattr(model, "_lowvram_decode", None) is None
    assert len(said) == 1 and "sets alora_invocation_tokens" in said[0] and "transformers' generate" in said[0]


def test_generation_settings_outside_the_loop_go_to_transformers_said_once(tiny_model_dir):
    """top_h, watermarking_config, max_time, dola_layers (settings of transformers 5.17's GenerationConfig the loop
    does not implement) each send the call to transformers' generate, said once in the log per setting."""
    model = _tiny_peft("llama", dtype=torch.float32, targets=["q_proj", "v_proj"])
    said = []
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True),
                     log=said.append)
    base = dict(input_ids=_IDS, attention_mask=_MASK, max_new_tokens=2, pad_token_id=0)
    with torch.no_grad():
        for setting in (dict(top_h=0.4, do_sample=True), dict(watermarking_config={"greenlist_ratio": 0.5}),
                        dict(max_time=30.0)):
            for _ in range(2):
                model.generate(**base, **setting)
        for _ in range(2):  # transformers 5.17 runs DoLa as Hub code, and says so: its error, not our loop's tokens
            with pytest.raises(ValueError, match="Dola Generation requires `trust_remote_code=True`"):
                model.generate(**base, dola_layers="low")
        assert model._lowvram_decode_calls == 0
        model.generate(**base, do_sample=True)
    assert model._lowvram_decode_calls == 1
    assert [line.split(" with ")[1].split("=")[0] for line in said] == ["top_h", "watermarking_config", "max_time",
                                                                        "dola_layers"], said


def test_lora_on_a_layer_other_than_a_linear_is_sampled_unmerged_and_exactly():
    """LoRA on the input embeddings (PEFT's lora.Embedding, plain options: only the layer type tells): `mergeable`
    refuses it, and the sampled tokens (multinomial sampler, one seed) are transformers' generate's."""
    model = _tiny_peft("llama", targets=["embed_tokens", "q_proj"])
    assert "lora.layer.Embedding" in decoding.mergeable(model)
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="multinomial", merge_lora=True, fused=True))
    kwargs = dict(input_ids=_IDS, attention_mask=_MASK, max_new_tokens=12, do_sample=True, top_k=0, top_p=1.0,
                  temperature=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        torch.manual_seed(9)
        ours = model.generate(**kwargs)
        torch.manual_seed(9)
        theirs = _plain_generate(model, **kwargs)
    assert model._lowvram_decode_calls == 1 and torch.equal(ours, theirs)


def test_merged_copies_are_reused_while_the_adapter_holds_and_freed_by_a_training_forward():
    """Sampled calls on the fused layers merge once while the adapter is unchanged: the next call reads the same
    copies and samples what a fresh merge samples. A no-grad forward leaves them; a forward with gradients (a training
    step) frees them. After a real optimizer step, an optimizer that writes through `.data` (no version bump), a load
    of adapter weights, or with the adapter off, the next call merges anew and samples exactly what a model that never
    held copies samples."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from lowvram_grpo.model import fused_decode

    model = _tiny_peft("llama", dtype=torch.bfloat16)
    decoding.install(model, decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True))
    inner = model.get_base_model()
    kwargs = dict(input_ids=_IDS, attention_mask=_MASK, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0,
                  eos_token_id=None)

    def sample():
        torch.manual_seed(3)
        return model.generate(**kwargs)

    def held():
        return fused_decode._MERGED[inner][1] if inner in fused_decode._MERGED else None

    def fresh_merge(previous):  # the next call merges anew and samples what a model without held copies samples
        out = sample()
        assert held() is not None and held() is not previous
        fused_decode._MERGED.pop(inner)
        assert torch.equal(sample(), out)
        return out

    first = sample()
    copies = held()
    assert copies is not None and torch.equal(sample(), first) and held() is copies
    with torch.no_grad():
        model(input_ids=_IDS, attention_mask=_MASK)
    assert held() is copies
    model.train()
    loss = model(input_ids=_IDS, attention_mask=_MASK).logits.float().pow(2).mean()
    assert held() is None  # freed as the training forward starts
    model.eval()
    assert torch.equal(sample(), first)
    copies = held()
    loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=100.0).step()
    fresh_merge(copies)
    assert not torch.equal(held()[0]["qkv"][0], copies[0]["qkv"][0])  # the step moved the merged weights

    class DataWriter(torch.optim.Optimizer):  # writes through .data: the tensors' version counters do not move
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.mul_(0.5)
    copies = held()
    DataWriter([p for p in model.parameters() if p.requires_grad], {}).step()
    fresh_merge(copies)

    weights = {name: tensor * 2 for name, tensor in get_peft_model_state_dict(model).items()}
    copies = held()
    set_peft_model_state_dict(model, weights)
    fresh_merge(copies)

    copies = held()
    with model.disable_adapter():
        fresh_merge(copies)
