"""The model families people train today (Qwen3, Qwen3.5, Gemma 3 and 4, Llama 3.2, gpt-oss, SmolLM3), each a tiny
random model built from transformers' own config class (tests/tiny_families.py), through every path the hf backend
runs: priming, 2 GRPO steps, the held-out before/after, the adapter saved and loaded, and the merged export.
Also per family: our decode loop's greedy answers against transformers' generate (decoding.LOOP_TYPES are the model
types checked here); the fallback for any other type, said once; `data.chat_template_kwargs` reaching every prompt
the run templates; and the `think` answer format scored as the run scores it."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from tiny_families import FAMILIES, LOOP_ONLY, UNCHECKED, build

SHORT = ["train.max_steps=2", "train.num_generations=2", "train.max_completion_length=8", "data.eval_size=2",
         "eval.batch_size=2", "data.num_train=16", "train.max_prompt_length=384"]  # gpt-oss's system turn: ~280 tokens


def _sets(family: str, *extra: str) -> list[str]:
    folder = build(family)
    modules = {**FAMILIES, **UNCHECKED}[family][2]
    return [f"model.name={folder}", f"lora.target_modules=[{','.join(modules)}]", *SHORT, *extra]


def _run(tmp_path, sets, export=None, handle=None):
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.run.pipeline import run

    lines: list[str] = []
    result = run(load_config("tiny", sets), tmp_path / "run", "hf", log=lines.append, export=export, handle=handle)
    return result, lines


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_primes_trains_measures_saves_and_exports(family, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result, lines = _run(tmp_path, _sets(family, "prime.steps=2", "prime.batch_size=2"), export="merged16")
    summary = result.summary
    assert summary["status"] == "complete" and summary["steps"] == 2, summary.get("status")
    for column in ("before", "primed", "after"):  # the held-out before/after, on the same 2 questions
        assert summary[column]["n"] == 2 and len(summary[column]["strict_correct"]) == 2, column
    assert summary["priming"]["steps"] == 2
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(line.startswith("decode.loop=lowvram") for line in lines)  # our loop covers the family
    assert result.handle.model._lowvram_decode_calls > 0  # and generated its rollouts and answers

    adapter = result.adapter_dir
    trained = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(bool(v.abs().sum() > 0) for k, v in trained.items() if "lora_B" in k), "priming + GRPO moved nothing"
    ids = torch.tensor([[1, 5, 9, 20, 33, 40]])
    model = result.handle.model
    model.eval()
    with torch.no_grad():
        adapted = model(ids).logits.float()
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(build(family), dtype=torch.float32),
                                             str(adapter)).eval()
        assert torch.allclose(reloaded(ids).logits, adapted, atol=1e-5), "the saved adapter is not the trained one"
        exported = result.output_dir / "export-merged16"
        assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"  # the 16-bit export ...
        # ... of the adapted model: its weights' bf16 rounding alone, computed in float32 (a bf16 forward adds its own
        # rounding, which on an AVX2-only CPU reached the bound: 0.0500 on gemma4)
        merged = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        assert not hasattr(merged, "peft_config") and merged.config.model_type == model.config.model_type
        assert (merged(ids).logits.float() - adapted).abs().max() < 0.05


@pytest.mark.parametrize("family", [*FAMILIES, *LOOP_ONLY])
def test_our_decode_loop_answers_as_transformers_generate(family):
    """Greedy, a left-padded batch, 20 new tokens (past the 16-position sliding windows), a perturbed LoRA adapter:
    token for token transformers' generate. What decoding.LOOP_TYPES claims for each family's model type; every type
    it lists is checked here."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lowvram_grpo.model import decoding

    model = AutoModelForCausalLM.from_pretrained(build(family), dtype=torch.float32)
    assert model.config.model_type in decoding.LOOP_TYPES
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules={**FAMILIES, **LOOP_ONLY}[family][2]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.eval()
    ids = torch.tensor([[0, 0, 5, 9, 14, 3, 30, 31], [7, 1, 8, 2, 9, 4, 40, 41]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    settings = decoding.DecodeSettings("lowvram", "inverse_cdf", merge_lora=False)
    with torch.no_grad():
        theirs = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
        ours = decoding.decode(model, ids, mask, max_new_tokens=20, do_sample=False, eos_token_ids=[], pad_token_id=0,
                               settings=settings)
    assert torch.equal(ours, theirs)


def test_every_model_type_our_loop_claims_is_checked():
    from transformers import AutoConfig

    from lowvram_grpo.model import decoding

    checked = {AutoConfig.from_pretrained(build(family)).model_type for family in [*FAMILIES, *LOOP_ONLY]}
    assert set(decoding.LOOP_TYPES) == checked


@pytest.mark.slow
def test_a_model_type_our_loop_was_not_checked_on_generates_with_transformers_said_once(tmp_path):
    """A family outside decoding.LOOP_TYPES (a tiny Phi-3): the run generates with transformers' generate, and its
    log says so once; the fused layers asked for on a covered family that they do not cover (Gemma 3) fall back to
    our loop on transformers' layers, also said once."""
    result, lines = _run(tmp_path, _sets("phi3", "train.max_steps=1", "decode.loop=lowvram"))
    assert result.summary["status"] == "complete"
    said = [line for line in lines if line.startswith("decode.loop=lowvram")]
    assert len(said) == 1 and "model_type phi3" in said[0] and "transformers' generate" in said[0], lines
    assert not hasattr(result.handle.model, "_lowvram_decode_calls")
    result, lines = _run(tmp_path / "gemma3", _sets("gemma3", "train.max_steps=1", "decode.loop=lowvram",
                                                    "decode.merge_lora=true", "decode.fused=true"))
    said = [line for line in lines if line.startswith("decode.fused")]
    assert len(said) == 1 and "model_type gemma3_text" in said[0], lines
    assert result.handle.model._lowvram_decode_calls > 0


@pytest.mark.slow
def test_chat_template_kwargs_reach_every_prompt_the_run_templates(tmp_path):
    """Qwen3's template closes an empty <think> block in the generation prompt when enable_thinking is false:
    every prompt the model is fed in a run (TRL's rollouts, the held-out answers) ends with it, and priming's
    examples are rendered with it."""
    from lowvram_grpo.model.backends import load_model, prepare_backend
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.training.priming import example_pieces
    from lowvram_grpo.settings.resolve import resolve

    sets = _sets("qwen3", "train.max_steps=1", "data.chat_template_kwargs={enable_thinking: false}")
    config = load_config("tiny", sets)
    resolved = resolve(config, detect(), "hf")
    prepare_backend(resolved.backend)
    handle = load_model(resolved, log=lambda *_: None)
    fed: list[str] = []
    generate = handle.model.generate

    def observed(*args, **kwargs):  # records what the model is fed, changes nothing
        fed.extend(handle.tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=False))
        return generate(*args, **kwargs)

    handle.model.generate = observed
    _run(tmp_path, sets, handle=handle)
    assert len(fed) == 2 + 2 + 2  # 2 held-out questions before and after, one group of 2 rollouts
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert all(text.endswith(closed) for text in fed), [t[-60:] for t in fed if not t.endswith(closed)]
    question = load_questions(config.data)[0][0]
    pieces = example_pieces(handle.tokenizer, question, config.data.system_prompt, None, config.data.answer_format,
                            config.data.chat_template_kwargs)
    assert pieces[0][0].endswith(closed) and not pieces[0][1]


@pytest.mark.slow
def test_a_think_format_run_scores_a_think_completion_right_and_a_malformed_one_wrong(tmp_path):
    """A run in the `think` answer format (a Qwen3-style thinking template): its priming examples are in that format,
    its summary says the held-out answers were read in it, and its own config and rewards score a hand-written
    <think> completion right and malformed ones wrong: the same answer inside the thinking only, and a second
    <think> block."""
    from lowvram_grpo.model.handle import Completion
    from lowvram_grpo.settings.config import config_from_dict
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.evaluate.evaluation import score
    from lowvram_grpo.settings.plans import run_plan
    from lowvram_grpo.training.priming import example_pieces
    from transformers import AutoTokenizer

    sets = _sets("qwen3", "train.max_steps=1", "prime.steps=1", "prime.batch_size=2", "data.answer_format=think",
                 "rewards.names=[think_format,think_correctness]")
    result, _ = _run(tmp_path, sets)
    config = config_from_dict(yaml.safe_load((result.output_dir / "config.yaml").read_text()))
    assert config.data.answer_format == "think" and "<think>" in config.data.system_prompt
    assert result.summary["after"]["protocol"]["answer_format"] == "think"
    question = load_questions(config.data)[1][0]
    row = to_prompt_rows([question], config.data.system_prompt)[0]
    gold = row["answer"]
    right = f"<think>\nLet me add: the total is {gold}.\n</think>\n\nThe answer is {gold}."
    only_thought = f"<think>\nThe answer is {gold}.\n</think>\n\nI am not sure."
    twice = f"<think>\nhm\n</think>\n<think>\nagain\n</think>\n\n{gold}"
    numbers = score([row] * 3, [Completion(t, 10) for t in (right, only_thought, twice)], run_plan(config).eval)
    assert numbers["strict_correct"] == [1, 0, 0]
    assert numbers["format_rate"] == pytest.approx(2 / 3)  # the second one is well formed, only wrong
    assert numbers["reward_mean"] == pytest.approx((2.5 + 0.5 + 2.0) / 3)  # think_correctness reads
                                                                           # after the last </think>
    tokenizer = AutoTokenizer.from_pretrained(build("qwen3"))
    pieces = example_pieces(tokenizer, question, config.data.system_prompt, None, config.data.answer_format)
    assert pieces[-1][0].startswith("<think>\n") and f"</think>\n\n{gold}" in pieces[-1][0]
