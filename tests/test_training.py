"""A real tiny GRPO run in this process (hf backend): base weights stay frozen, the saved adapter
reloads with plain PEFT to the same logits, and load_lora refuses adapters that do not fit."""
import json

import pytest
import torch

from lowvram_grpo.model.backends import SamplingParams
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.model.lora_io import AdapterError
from lowvram_grpo.run.pipeline import run

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("train") / "run"
    config = load_config("tiny", ["train.max_steps=3", "eval.enabled=false"])
    result = run(config, out, backend="hf", log=lambda *_: None)
    return result, tiny_model_dir


def _fresh_base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_base_weights_are_unchanged_by_training(trained):
    result, base_dir = trained
    base = _fresh_base(base_dir).state_dict()
    tuned = result.handle.model.get_base_model().state_dict()
    compared = 0
    for name, value in tuned.items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        assert torch.equal(value, base[key]), name
        compared += 1
    assert compared >= len(base) - 1


def test_saved_adapter_loads_with_plain_peft_and_gives_the_same_logits(trained):
    from peft import PeftModel

    result, base_dir = trained
    reloaded = PeftModel.from_pretrained(_fresh_base(base_dir), str(result.adapter_dir)).eval()
    model = result.handle.model.eval()
    ids = result.handle.tokenizer("Ava has 3 apples and buys 4 more.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        base_logits = _fresh_base(base_dir)(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, base_logits, atol=1e-4), "the adapter should change the logits"


def test_fast_generate_with_lora_request_matches_the_trained_model(trained):
    result, _ = trained
    handle = result.handle
    prompt = [{"role": "user", "content": "Ava has 3 apples. How many?"}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    request = handle.load_lora(result.adapter_dir)
    with_saved = handle.fast_generate([prompt], greedy, lora_request=request)
    base = handle.fast_generate([prompt], greedy, lora_request=None)
    # the in-memory trained adapter, generated directly
    tok = handle.tokenizer
    text = handle.apply_chat_template(prompt)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = handle.model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                                    use_cache=True)
    direct = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert with_saved == [direct]
    assert isinstance(base[0], str)
    assert handle.model.active_adapter == "default", "generation must restore the training adapter"


def test_sampling_with_a_seed_is_reproducible(trained):
    handle = trained[0].handle
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=10, seed=123)
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    assert handle.fast_generate([prompt], params) == handle.fast_generate([prompt], params)


def test_load_lora_refuses_incomplete_and_mismatched_adapters(trained, tmp_path):
    handle = trained[0].handle
    with pytest.raises(AdapterError, match="no adapter"):
        handle.load_lora(tmp_path / "nothing")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="incomplete"):
        handle.load_lora(partial)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="corrupt"):
        handle.load_lora(corrupt)

    # an adapter trained on a differently shaped Llama
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    peft_other = get_peft_model(other, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    peft_other.save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterError, match="does not fit this base model"):
        handle.load_lora(tmp_path / "other")


def test_save_lora_is_atomic_and_leaves_no_staging_dirs(trained, tmp_path):
    handle = trained[0].handle
    target = tmp_path / "adapter"
    handle.save_lora(target)
    first = (target / "adapter_model.safetensors").read_bytes()
    handle.save_lora(target)  # replacing an existing adapter
    assert (target / "adapter_model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.parametrize("loop", ["transformers", "lowvram"])
def test_sampling_inside_the_trainer_keeps_the_kv_cache_under_gradient_checkpointing(tmp_path, tiny_model_dir, loop):
    """In train mode with gradient checkpointing on, transformers (5.17) drops every layer's KV cache
    while generate still feeds only the newest token: SmolLM2 then answers "1------". TRL samples in
    train mode but turns checkpointing off around generate; this guards that (a TRL/transformers
    upgrade that loses it would train on garbage samples): every decoding step reads the cache. The same for
    our decode loop on transformers' layers (decode.fused=false: the fused layers do not run those modules; their
    own cache is checked against transformers' logits in tests/test_decoding.py)."""
    from datasets import Dataset  # noqa: F401  (imported by build_trainer; keeps import order obvious)

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false", "memory.gradient_checkpointing=true",
                                  f"decode.loop={loop}", "decode.fused=false"])
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q, config.data.system_prompt), tmp_path)
    assert trainer.args.gradient_checkpointing
    assert (getattr(handle.model, "_lowvram_decode", None) is not None) == (loop == "lowvram")

    seen = []  # (in generation?, layer training flag, cache given?) per call of the first decoder layer
    in_generation = [False]
    layer = handle.model.get_base_model().model.layers[0]
    layer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((in_generation[0], mod.training,
                                               kwargs.get("past_key_values") is not None)),
        with_kwargs=True,
    )
    original = trainer._generate_single_turn

    def flagged(*a, **kw):
        in_generation[0] = True
        try:
            return original(*a, **kw)
        finally:
            in_generation[0] = False

    trainer._generate_single_turn = flagged
    trainer.train()
    decoding = [s for s in seen if s[0]]
    assert len(decoding) > 2
    assert all(cache for _, _, cache in decoding[1:]), "decoding steps after the prefill must read the KV cache"
    assert any(training for gen, training, _ in seen if not gen), "the training pass runs in train mode"


def test_effective_settings_are_read_back_from_the_trainer_as_plain_values(tmp_path, tiny_model_dir):
    """What the built trainer uses, JSON-ready, and what it changed from the config (here: nothing on hf)."""
    import json as _json

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.training.grpo import build_trainer, describe_effective

    config = load_config("tiny", ["train.loss_type=dr_grpo"])
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q[:8], config.data.system_prompt), tmp_path)
    effective = trainer.effective_settings
    assert _json.loads(_json.dumps(effective)) == effective
    used = effective["settings"]
    assert used["loss_type"] == "dr_grpo" and used["optim"] == "adamw_8bit" and used["lr_scheduler_type"] == "constant"
    assert used["reward_weights"] == [1.0] * 6 and effective["changed"] == {}
    assert effective["trainer"] == "GRPOTrainer"  # the hf backend: TRL's own class, named in the log line
    assert describe_effective(effective).startswith(
        "GRPO as the trainer runs it: trainer=GRPOTrainer loss_type=dr_grpo ")


def test_loss_variants_reach_trls_config(tmp_path):
    """train.loss_type / scale_rewards / mask_truncated_completions are handed to GRPOConfig as set."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.training.grpo import grpo_args

    config = load_config(
        "tiny", ["train.loss_type=dr_grpo", "train.scale_rewards=none", "train.mask_truncated_completions=true"])
    args = grpo_args(resolve(config, profile("cpu")), tmp_path)
    assert (args.loss_type, args.scale_rewards, args.mask_truncated_completions) == ("dr_grpo", "none", True)
    default = grpo_args(resolve(load_config("tiny"), profile("cpu")), tmp_path)
    assert (default.scale_rewards, default.mask_truncated_completions) == ("group", False)
