"""Supervised priming on the tiny model: the completion loss falls and the run reports the primed column."""
from lowvram_grpo.model.backends import load_model
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.task.data import load_questions
from lowvram_grpo.evaluate.evaluation import format_table
from lowvram_grpo.training.priming import _batch, completion_loss, prime

import pytest  # noqa: E402

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def test_priming_lowers_the_completion_loss(tiny_model_dir):
    config = load_config("tiny", ["prime.steps=30", "prime.learning_rate=5e-3", "prime.batch_size=4"])
    handle = load_model(resolve(config, detect(), "hf"))
    train, _ = load_questions(config.data)
    result = prime(handle, train, handle.plan.prime, log=lambda *_: None)
    assert result["steps"] == 30
    first, last = result["losses"][:5], result["losses"][-5:]
    assert sum(last) / 5 < 0.95 * sum(first) / 5


def test_prompt_tokens_are_masked(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = [[("prompt one", False), ("target" + tok.eos_token, True)],
              [("p", False), ("a longer target here" + tok.eos_token, True)]]
    ids, attention, labels = _batch(tok, pieces, 512)
    n_prompt = len(tok("prompt one", add_special_tokens=False)["input_ids"])
    assert (labels[0, :n_prompt] == -100).all() and (labels[0, n_prompt] != -100)
    assert attention[1].sum() == len(tok("p", add_special_tokens=False)["input_ids"]) + len(
        tok("a longer target here" + tok.eos_token, add_special_tokens=False)["input_ids"])


def test_table_shows_grpo_gain_separately():
    row = {"reward_mean": 0.0, "accuracy_strict": 0.0, "accuracy_lenient": 0.0, "format_rate": 0.0,
           "mean_completion_tokens": 10.0}
    table = format_table(row, {**row, "reward_mean": 1.0}, {**row, "reward_mean": 0.6})
    assert "primed" in table and "primed -> after: +0.400" in table


def test_completion_loss_equals_the_models_own_labels_loss(tiny_model_dir):
    """The chunked loss (no full logits) is the model's cross-entropy, value and gradients."""
    import torch

    config = load_config("tiny", ["memory.gradient_checkpointing=true"])
    handle = load_model(resolve(config, detect(), "hf"))
    model = handle.model
    model.train()
    eos = handle.tokenizer.eos_token
    ids, attention, labels = _batch(handle.tokenizer, [[("Ava has 3 apples.", False),
                                                        ("<answer>\n7\n</answer>" + eos, True)],
                                                       [("Q", False), ("ok" + eos, True)]], 512)
    lora = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():  # non-zero B so the LoRA path carries gradient to A too
        for p in lora:
            p.add_(0.01 * torch.randn_like(p))
    expected = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    expected_grads = torch.autograd.grad(expected, lora)
    got = completion_loss(model, ids, attention, labels)
    got_grads = torch.autograd.grad(got, lora)
    assert torch.allclose(got, expected, atol=1e-5)
    assert all(torch.allclose(g, e, atol=1e-6, rtol=1e-4) for g, e in zip(got_grads, expected_grads))


def test_with_beta_the_kl_reference_is_the_primed_model_not_the_base(tiny_model_dir, tmp_path):
    """A real run, priming then GRPO with train.beta > 0: TRL (1.15, hf backend) freezes a copy of the adapter it is
    handed as the 'ref' adapter, so the KL anchor is the *primed* model. The ref weights are the primed adapter's
    (and not zero: the base would be a different anchor), and the KL TRL logs at step 1, before any update, is 0."""
    import json

    import torch
    from safetensors.torch import load_file

    from lowvram_grpo import train

    result = train("tiny", ["prime.steps=6", "prime.learning_rate=5e-3", "prime.batch_size=4", "train.beta=0.04",
                            "train.max_steps=1", "train.save_steps=2", "eval.enabled=false"],
                   output_dir=str(tmp_path / "run"))
    model = result.handle.model
    assert "ref" in model.peft_config
    primed = load_file(str(tmp_path / "run" / "primed_adapter" / "adapter_model.safetensors"))
    ref = {name.replace(".ref.", "."): p.detach() for name, p in model.named_parameters() if ".ref." in name}
    assert ref.keys() == primed.keys() and primed
    assert all(torch.equal(ref[k].to(primed[k].dtype), primed[k]) for k in primed)
    assert max(float(t.abs().max()) for k, t in primed.items() if "lora_B" in k) > 1e-3  # primed != base
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["kl"] == pytest.approx(0.0, abs=1e-7)


def test_a_measured_adapter_is_released_so_grpo_checkpoints_hold_the_trained_adapter_alone(tiny_model_dir, tmp_path):
    """A real run that measures its primed adapter (the transformers engine loads it into the PEFT model beside
    the trained one): released after measuring, it is neither kept in memory through GRPO nor written into TRL's
    checkpoints (save_pretrained writes every adapter of the model; a resume would load it back). What stays beside
    the trained adapter is TRL's frozen 'ref' copy (tiny: train.beta 0.04), which a resume needs."""
    from lowvram_grpo import train

    run = tmp_path / "run"
    result = train("tiny", ["prime.steps=2", "train.max_steps=2", "train.save_steps=1"], output_dir=str(run))
    assert result.summary["primed"] and result.summary["after"]
    checkpoints = sorted(run.glob("checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-1", "checkpoint-2"]
    for checkpoint in checkpoints:
        assert (checkpoint / "adapter_model.safetensors").is_file()
        assert [p.name for p in checkpoint.iterdir() if (p / "adapter_config.json").is_file()] == ["ref"]
    model = result.handle.model
    assert sorted(model.peft_config) == ["default", "ref"] and model.active_adapter == "default"
    assert all(p.requires_grad for name, p in model.named_parameters() if ".default." in name)


def test_priming_with_the_calculator_trains_on_transcripts_that_call_it(tiny_model_dir):
    """With the built-in calculator among the run's tools, a worked example becomes the transcript GRPO's tool loop
    would make: the prompt with the tools' schemas (masked), a turn calling the calculator once per calculation of
    the solution, written as the model's template writes calls and parsed back as TRL parses them (trained), the
    results (masked), the formatted answer (trained)."""
    from lowvram_grpo.training.priming import calculations, example_pieces
    from lowvram_grpo.task.rewards import xml_formatted
    from lowvram_grpo.task.tools import calculator
    from lowvram_grpo.task.user_code import of

    config = load_config("tiny", ["tools.names=[calculator]"])
    handle = load_model(resolve(config, detect(), "hf"))
    tok = handle.tokenizer
    train, _ = load_questions(config.data)
    question = next(q for q in train if len(calculations(q.solution)) == 2)  # a two-step problem: two calls
    pieces = example_pieces(tok, question, config.data.system_prompt, of(handle.plan).prompt_tools())
    assert [trained for _, trained in pieces] == [False, True, False, True]
    head, call, results, answer = (text for text, _ in pieces)
    assert "<tools>" in head and '"calculator"' in head and head.endswith("<|im_start|>assistant\n")
    parsed = tok.parse_response(call, prefix=head)
    expressions = [c["function"]["arguments"]["expression"] for c in parsed["tool_calls"]]
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["calculator", "calculator"]
    assert expressions == calculations(question.solution)
    assert call.endswith(tok.eos_token)
    values = [calculator(e) for e in expressions]
    assert values[-1] == question.answer
    assert all(f"<tool_response>\n{v}\n</tool_response>" in results for v in values)
    assert results.endswith("<|im_start|>assistant\n")
    assert answer == xml_formatted(question.solution, question.answer) + tok.eos_token

    ids, _, labels = _batch(tok, [pieces], 4096)  # the tiny tokenizer spells most words out
    trained = [i for i, l in zip(ids[0].tolist(), labels[0].tolist()) if l != -100]
    assert tok.decode(trained) == call + answer  # the tool results and the prompt are not trained on

    plain = load_config("tiny")  # without tools: the example as before, prompt and answer
    assert [t for t, _ in example_pieces(tok, question, plain.data.system_prompt, None)] == [
        handle.apply_chat_template(plain.data.system_prompt and [
            {"role": "system", "content": plain.data.system_prompt}, {"role": "user", "content": question.question}]),
        answer]


def test_calculations_read_gsm8k_annotations_and_the_builtin_equations():
    from lowvram_grpo.training.priming import calculations

    assert (calculations("Natalia sold 48/2 = <<48/2=24>>24 clips in May. Altogether <<48+24=72>>72.")
            == ["48/2", "48+24"])
    assert calculations("After buying, Ava has 3 + 4 = 7 apples. After giving 2 away, 7 - 2 = 5.") == ["3 + 4", "7 - 2"]
    assert calculations("She has seventy apples.") == []
