"""decode.weights=int8 (opt-in): our decode loop's fused layers sample from int8 base weights (FBGEMM's dynamic int8
linear, packed once per model: fused_decode.build_int8_base through internals.int8_prepack / int8_linear) plus the
adapter unmerged, on real components and tiny models built here.

What holds: resolve() decides it once (int8 only where the fused layers run on a CPU; refused elsewhere before anything
loads, one line with the fix; the dry-run line says which weights sampled tokens read and that the importance-sampling
correction is on for them); the product's generate really multiplies with the quantized op (counted) and its sampled
tokens' log-probs are those of the int8 layers, close to the bf16 layers' and not equal to them; greedy answers never
touch it; a model the fused layers do not cover says so once and reads its own weights."""
import dataclasses

import pytest
import torch
from conftest import load_handle, perturb_adapter

from lowvram_grpo.model import decoding, fused_decode
from lowvram_grpo.core import internals
from lowvram_grpo.core.errors import BackendError, ConfigError, ResolveError
from lowvram_grpo.settings.config import DecodeConfig, load_config
from lowvram_grpo.settings.hardware import profile
from lowvram_grpo.settings.resolve import resolve

CPU = profile("cpu")
INT8 = decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True, weights="int8")
BF16 = decoding.DecodeSettings(loop="lowvram", sampler="inverse_cdf", merge_lora=True, fused=True)


# --------------------------------------------------------------------------- the setting, and resolve's decision

def test_the_setting_takes_auto_bf16_or_int8():
    assert DecodeConfig().weights == "auto"
    assert load_config("smollm2_cpu", ["decode.weights=int8"]).decode.weights == "int8"
    with pytest.raises(ConfigError, match=r"^decode\.weights must be one of auto, bf16, int8; got 'int4'$"):
        DecodeConfig(weights="int4")


def test_resolve_takes_int8_where_the_fused_layers_run_and_says_so():
    default = resolve(load_config("smollm2_cpu", []), CPU, "hf")
    assert default.decode_weights == "bf16" and default.decode.weights == "bf16"  # auto = bf16: today's behaviour
    assert f"fused layers when sampling; sampled tokens read {default.dtype} weights" in default.describe()
    assert "our decode loop samples (merged/fused 16-bit weights" in default.is_reason
    int8 = resolve(load_config("smollm2_cpu", ["decode.weights=int8"]), CPU, "hf")
    assert (int8.decode_loop, int8.decode_merge_lora, int8.decode_fused, int8.decode_weights) == (
        "lowvram", True, True, "int8")
    assert int8.decode == INT8 and int8.summary()["decode_weights"] == "int8"
    assert "fused layers when sampling; sampled tokens read int8 weights (decode.weights=int8" in int8.describe()
    assert int8.is_correction and int8.is_reason.startswith("auto -> on: our decode loop samples from int8 weights")
    assert "IS correction on (token_truncate): auto -> on: our decode loop samples from int8 weights" in int8.describe()
    assert int8.is_mode == "token_truncate" and default.is_mode == "sequence_mask"  # one ratio a token under int8
    unmerged = resolve(load_config("smollm2_cpu", ["decode.weights=int8", "decode.merge_lora=false"]), CPU, "hf")
    assert (unmerged.decode_merge_lora, unmerged.decode_fused, unmerged.decode_weights) == (False, True, "int8")
    off = resolve(load_config("smollm2_cpu", ["decode.weights=int8", "train.is_correction=off"]), CPU, "hf")
    assert not off.is_correction and any(n.startswith("decode.weights=int8 with train.is_correction=off")
                                         for n in off.notes)


@pytest.mark.parametrize("preset, sets, hardware, backend, says", [
    ("smollm2_cpu", [], "t4", "hf", "and this run is on CUDA (Tesla T4): set decode.weights=auto"),
    ("qwen1_5b_4bit", [], "rtx4090", "unsloth", "and this run is on CUDA (NVIDIA GeForce RTX 4090)"),
    ("smollm2_cpu", ["model.generation=vllm"], "cpu+vllm", "hf",
     "and model.generation=vllm samples with vLLM: set decode.weights=auto"),
    ("smollm2_cpu", ["memory.load_in_4bit=true"], "cpu", "hf",
     "which merge the adapter into 16-bit weights, and memory.load_in_4bit is on: set decode.weights=auto or "
     "memory.load_in_4bit=false"),
    ("smollm2_cpu", ["decode.loop=transformers"], "cpu", "hf",
     "and decode.loop=transformers samples with transformers' generate: set decode.loop=auto or decode.weights=auto"),
    ("smollm2_cpu", ["decode.fused=false"], "cpu", "hf",
     "and decode.fused=false keeps them off: set decode.fused=auto or decode.weights=auto"),
    ("smollm2_cpu", ["model.name=google/gemma-3-1b-it"], "cpu", "hf",
     "which cover llama, mistral, qwen2, qwen3, and model.name google/gemma-3-1b-it is model type gemma3: set "
     "decode.weights=auto"),
    ("smollm2_cpu", ["tools.names=[calculator]"], "cpu", "hf",
     "need the importance-sampling correction, which tools or an environment keep off"),
])
def test_int8_is_refused_wherever_the_fused_layers_do_not_sample(preset, sets, hardware, backend, says):
    hardware = dataclasses.replace(CPU, vllm_installed=True) if hardware == "cpu+vllm" else profile(hardware)
    config = load_config(preset, [*sets, "decode.weights=int8"])
    with pytest.raises(ResolveError) as refused:
        resolve(config, hardware, backend)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("decode.weights=int8 quantizes the weights of our decode loop's "
                                                "fused layers (FBGEMM's CPU int8 linear)") and says in line, line
    resolve(load_config(preset, list(sets)), hardware, backend)  # the same run without int8 resolves


def test_the_door_registers_the_deprecated_quantized_api(monkeypatch):
    assert internals.missing_reaches() == []
    monkeypatch.delattr(torch, "quantize_per_channel")
    assert internals.missing_reaches() == ["torch.quantize_per_channel"]
    with pytest.raises(BackendError, match=r"uses torch\.quantize_per_channel, .*pip install .*torch==2\.13\.0"):
        internals.int8_prepack(torch.ones(4, 8))


def test_int8_linear_is_close_to_the_float_product():
    """Per output row scales: a row's largest entry is exactly representable, the product within ~2% of float32."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=generator) * 0.1).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, generator=generator).to(torch.bfloat16)
    out = internals.int8_linear(x, internals.int8_prepack(weight, bias))
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 96)
    assert ((out.float() - ref).abs().mean() / ref.abs().mean()).item() < 0.02


# --------------------------------------------------------------------------- the product's generate on int8 weights

def _handle(sets=()):
    return load_handle("tiny", sets, CPU)


_perturb_adapter = perturb_adapter


@pytest.fixture
def int8_calls(monkeypatch):
    """How many times the fused layers multiplied with the quantized op (internals.int8_linear, counted)."""
    calls = []
    real = internals.int8_linear

    def counted(x, packed):
        calls.append(tuple(x.shape))
        return real(x, packed)

    monkeypatch.setattr(internals, "int8_linear", counted)
    return calls


def _forced(inner, ids, mask, tokens, weights):
    """Float32 logits [B, N, V] of the fused layers on `weights` at each of `tokens` [B, N] (teacher-forced: the
    same pick every call, so the int8 and bf16 layers are compared on the same sequences)."""
    logits, step = [], iter(range(tokens.shape[1]))

    def pick(scores):
        logits.append(scores.float())
        return tokens[:, next(step)]

    with torch.no_grad():
        fused_decode.decode(inner, ids, mask, max_new_tokens=tokens.shape[1], eos_token_ids=[], pad_token_id=None,
                            pick=pick, weights=weights)
    return torch.stack(logits, dim=1)


def _gathered(logits, tokens):
    return logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def test_int8_sampled_decode_runs_through_the_products_generate(tiny_model_dir, int8_calls):
    """resolve -> load_model -> the installed generate, the tiny preset with decode.weights=int8: a sampled call
    runs every fused matmul (4 a layer and the LM head, at every token step) through the quantized op, and the
    log-probs the sampler hands TRL (decoding.sampler_logprobs) are exactly the int8 layers' at those tokens."""
    handle = _handle(["decode.weights=int8"])
    model, tokenizer = handle.model, handle.tokenizer
    assert internals.mark(model, "decode") == INT8
    _perturb_adapter(model, 0.05)
    inner = model.get_base_model()
    tokenizer.padding_side = "left"
    batch = tokenizer(["a b c d", "e f"], return_tensors="pt", padding=True, add_special_tokens=False)
    never = inner.config.vocab_size + 3
    torch.manual_seed(0)
    with torch.no_grad(), decoding.sampler_logprobs(model) as steps:
        out = model.generate(**batch, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=never, pad_token_id=tokenizer.pad_token_id)
    new = out[:, batch["input_ids"].shape[1]:]
    assert new.shape == (2, 8) and internals.mark(model, "decode_calls") == 1
    # prefill + 7 token steps (the once-per-model recording prefill before them runs on the 16-bit layers)
    assert len(int8_calls) == 8 * (4 * inner.config.num_hidden_layers + 1)
    int8 = _forced(inner, batch["input_ids"], batch["attention_mask"], new, "int8")
    assert torch.equal(torch.stack(steps, dim=1), _gathered(int8, new))
    bf16 = _forced(inner, batch["input_ids"], batch["attention_mask"], new, "bf16")
    assert not torch.equal(int8, bf16)  # int8 is really what was sampled from


def test_int8_log_probs_stay_close_to_bf16(tiny_model_dir, int8_calls):
    """The tiny preset (float32) with decode.weights=int8 and a trained-looking adapter, 4 chat prompts x 16 tokens
    sampled through the installed generate, then the fused layers teacher-forced on those tokens on int8 and on bf16
    (the model's own) weights, and the trainer's forward (PEFT, adapter unmerged). A real model's gap is far larger
    (SmolLM2-135M: docs/results.md), hence the correction. Bounds leave room for another CPU's rounding."""
    handle = _handle(["decode.weights=int8"])
    model, tokenizer = handle.model, handle.tokenizer
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    inner = model.get_base_model()
    tokenizer.padding_side = "left"
    texts = ["What is 7 * 8?", "Tom has 3 apples and buys 5 more. How many?", "Hello, tell me a story about a cat.",
             "2+2="]
    batch = tokenizer([tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                     add_generation_prompt=True) for t in texts],
                      return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    torch.manual_seed(0)
    with torch.no_grad(), decoding.sampler_logprobs(model) as steps:
        out = model.generate(**batch, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    assert int8_calls
    new = out[:, ids.shape[1]:]
    int8 = _forced(inner, ids, mask, new, "int8")
    bf16 = _forced(inner, ids, mask, new, "bf16")
    assert torch.equal(torch.stack(steps, dim=1), _gathered(int8, new))
    gap = (_gathered(int8, new) - _gathered(bf16, new)).abs()
    agree = (int8.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    with torch.no_grad():  # the trainer's forward: PEFT's, the adapter unmerged
        trainer = model(input_ids=out, attention_mask=full_mask,
                        position_ids=fused_decode.prompt_positions(full_mask)).logits[:, ids.shape[1] - 1:-1].float()
    to_int8 = (_gathered(trainer, new) - _gathered(int8, new)).abs().mean().item()
    to_bf16 = (_gathered(trainer, new) - _gathered(bf16, new)).abs().mean().item()
    print(f"mean |dlogp| {gap.mean().item():.5f} max {gap.max().item():.4f} argmax {agree:.3f}; "
          f"trainer vs int8 {to_int8:.5f}, vs bf16 {to_bf16:.2e}")
    assert 0 < gap.mean().item() < 0.01 and gap.max().item() < 0.05 and agree >= 0.85
    assert to_bf16 < 1e-3 and to_int8 > 10 * to_bf16  # the sampler's gap is int8's, not the merge's


def test_greedy_answers_never_read_int8(tiny_model_dir, int8_calls):
    """Greedy answers stay transformers' generate's, token for token, with decode.weights=int8 installed: the
    quantized op is never called."""
    handle = _handle(["decode.weights=int8"])
    model, tokenizer = handle.model, handle.tokenizer
    _perturb_adapter(model, 0.05)
    tokenizer.padding_side = "left"
    batch = tokenizer(["a b c d", "e f", "g"], return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(**batch, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        ours = model.generate(**kwargs)
        model.eval()
        theirs = type(model).generate(model, **kwargs)
    assert torch.equal(ours, theirs) and internals.mark(model, "decode_calls") == 1
    assert int8_calls == []


def test_a_model_the_fused_layers_do_not_cover_says_it_reads_its_own_weights():
    """Qwen2 with a sliding window: our loop, transformers' layers, the model's own weights; said once."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=50, use_sliding_window=True, sliding_window=8)
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    said = []
    decoding.install(model, INT8, log=said.append)
    lines = [line for line in said if line.startswith("decode.weights=int8")]
    assert lines == ["decode.weights=int8: the fused layers do not run for this model (sliding-window attention): "
                     "sampled tokens read the model's own float32 weights"]


# --------------------------------------------------------------------------- the base packed once, the adapter unmerged

def _tiny_llama(tie: bool = False, targets=("q_proj", "v_proj", "gate_proj", "down_proj")):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, tie_word_embeddings=tie)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    _perturb_adapter(model, 0.05)
    return model.eval()


def test_the_adapter_is_added_unmerged_by_peft_arithmetic():
    """Each fused group's unmerged adapter term equals PEFT's own get_delta_weight of its projections (those without
    LoRA, k and up here, contribute zero rows), in float32."""
    model = _tiny_llama()
    inner = model.get_base_model()
    for name, modules in fused_decode._groups(inner.model.layers[1]).items():
        lora = fused_decode._unmerged_lora(modules, torch.float32)
        x = torch.randn(3, 5, fused_decode._base_layer(modules[0]).weight.shape[1])
        deltas = [m.get_delta_weight("default") if hasattr(m, "lora_A") else
                  torch.zeros_like(fused_decode._base_layer(m).weight) for m in modules]
        want = torch.nn.functional.linear(x, torch.cat(deltas))
        if name in ("o",):  # no LoRA on o_proj here
            assert lora is None
            continue
        got = torch.nn.functional.linear(torch.nn.functional.linear(x, lora[0]), lora[1])
        assert torch.allclose(got, want, atol=1e-6), name


def test_the_base_is_packed_once_and_a_changed_adapter_moves_the_samples_without_a_repack(monkeypatch):
    """Through the product's generate: the first sampled call packs every fused group once (4 a layer and the head),
    later calls reuse them; an optimizer-like in-place change of the adapter changes the int8 layers' logits (the
    adapter really shifts what is sampled) with no repack; a changed base weight (a merge would) repacks."""
    model = _tiny_llama()
    decoding.install(model, INT8)
    inner = model.get_base_model()
    packs = []
    real = internals.int8_prepack
    monkeypatch.setattr(internals, "int8_prepack", lambda w, b=None: packs.append(w.shape) or real(w, b))
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    groups = 4 * inner.config.num_hidden_layers + 1

    def generate():
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)

    out = generate()
    generate()
    assert len(packs) == groups
    new = out[:, ids.shape[1]:]
    before = _forced(inner, ids, mask, new, "int8")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(3.0)
    after = _forced(inner, ids, mask, new, "int8")
    assert len(packs) == groups
    bf16_after = _forced(inner, ids, mask, new, "bf16")
    shift = (after - before).abs().mean().item()
    assert shift > 20 * (after - bf16_after).abs().mean().item()  # the adapter's move, far above int8's noise
    with torch.no_grad():
        inner.model.layers[0].mlp.up_proj.weight.add_(0.01)  # a base weight written in place
    _forced(inner, ids, mask, new, "int8")
    assert len(packs) == 2 * groups


def test_smoothing_carries_an_outlier_channel():
    """One input channel 50x the others (what a down projection sees): the smoothed int8 product (the per-channel
    maxima recorded, W * s, x / s) is several times closer to float32 than plain per-tensor-activation int8."""
    model = _tiny_llama()
    inner = model.get_base_model()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 128, generator=generator)
    x[..., 7] *= 50
    recorded = {key: torch.ones(64) for key in [(i, n) for i in range(2) for n in ("qkv", "o", "gate_up")] + ["head"]}
    recorded.update({(i, "down"): x.abs().reshape(-1, 128).amax(0) for i in range(2)})
    packed = fused_decode.build_int8_base(inner, recorded)
    weight = fused_decode._base_layer(inner.model.layers[0].mlp.down_proj).weight
    want = torch.nn.functional.linear(x, weight)
    smoothed = fused_decode.Int8Linear(*packed[(0, "down")])(x)
    plain = internals.int8_linear(x, internals.int8_prepack(weight))
    error = lambda got: ((got - want).abs().mean() / want.abs().mean()).item()  # noqa: E731
    assert error(smoothed) < 0.4 * error(plain), (error(smoothed), error(plain))


def test_a_tied_lm_head_with_lora_samples_right_and_the_embeddings_stay(tiny_model_dir):
    """lm_head among the LoRA targets on a model whose head is tied to its input embeddings: the int8 head adds the
    head's adapter unmerged (logits within int8 noise of the merged bf16 layers'), nothing is written through the
    tie."""
    model = _tiny_llama(tie=True, targets=("q_proj", "v_proj", "lm_head"))
    inner = model.get_base_model()
    embeddings = inner.model.embed_tokens.weight.detach().clone()
    ids, mask = torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4, dtype=torch.long)
    new = torch.tensor([[7, 8, 9]])
    int8 = _forced(inner, ids, mask, new, "int8")
    merged = _forced(inner, ids, mask, new, "bf16")
    unmerged_head = fused_decode._unmerged_lora((inner.get_output_embeddings(),), torch.float32)
    assert unmerged_head is not None
    assert (int8 - merged).abs().max().item() < 0.05 * merged.abs().max().item()
    assert torch.equal(inner.model.embed_tokens.weight, embeddings)
