"""Supervised priming on the tiny model: the completion loss falls and the run reports the primed column."""
from lowvram_grpo.backends import load_model
from lowvram_grpo.config import load_config
from lowvram_grpo.data import load_questions
from lowvram_grpo.evaluation import format_table
from lowvram_grpo.priming import _batch, prime


def test_priming_lowers_the_completion_loss(tiny_model_dir):
    config = load_config("tiny", ["prime.steps=30", "prime.learning_rate=5e-3", "prime.batch_size=4"])
    handle = load_model(config, "hf")
    train, _ = load_questions(config.data)
    result = prime(handle, train, config, log=lambda *_: None)
    assert result["steps"] == 30
    first, last = result["losses"][:5], result["losses"][-5:]
    assert sum(last) / 5 < 0.95 * sum(first) / 5


def test_prompt_tokens_are_masked(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, attention, labels = _batch(tok, ["prompt one", "p"], ["target", "a longer target here"], 512)
    n_prompt = len(tok("prompt one", add_special_tokens=False)["input_ids"])
    assert (labels[0, :n_prompt] == -100).all() and (labels[0, n_prompt] != -100)
    assert attention[1].sum() == len(tok("p", add_special_tokens=False)["input_ids"]) + len(
        tok("a longer target here" + tok.eos_token, add_special_tokens=False)["input_ids"])


def test_table_shows_grpo_gain_separately():
    row = {"reward_mean": 0.0, "accuracy": 0.0, "format_rate": 0.0, "mean_completion_tokens": 10.0}
    table = format_table(row, {**row, "reward_mean": 1.0}, {**row, "reward_mean": 0.6})
    assert "primed" in table and "primed -> after: +0.400" in table
