"""Reward functions that fail, a user's reward file, and the numerical guard, on real tiny GRPO runs."""
import json

import pytest
import torch

from conftest import run_cli
from lowvram_grpo.settings.plans import run_plan
from lowvram_grpo.core.errors import TrainingStopped
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.task.rewards import RewardError, guarded

ENV = {"OMP_NUM_THREADS": "1"}


def _returning(value):
    def fn(prompts, completions, **kwargs):
        return value(completions) if callable(value) else value
    return fn


def _raising(prompts, completions, **kwargs):
    raise KeyError("gold")


# What TRL 1.15's GRPOTrainer itself fails on (NaN, inf, None and bools it takes: tests/test_rewards.py)
BAD_REWARDS = [
    (_raising, "raised KeyError: 'gold'"),
    (_returning(lambda c: [1.0] * (len(c) + 1)), "returned 3 scores for 2 completions"),
    (_returning(lambda c: ["1.0", 2.0]), "returned '1.0' (str) as score 0"),
    (_returning(lambda c: [1.0, 2j]), "returned 2j (complex) as score 1"),
    (_returning(lambda c: [[1.0], [2.0]]), "returned [1.0] (list) as score 0"),
    (_returning(lambda c: {"a": 1.0, "b": 2.0}), "returned 'a' (str) as score 0"),
    (_returning(None), "returned NoneType, not a list of 2 numbers"),
    (_returning(0.5), "returned float, not a list of 2 numbers"),
    (_returning("12"), "returned str, not a list of 2 numbers"),
]


@pytest.mark.parametrize("fn, problem", BAD_REWARDS, ids=[p for _, p in BAD_REWARDS])
def test_a_bad_reward_stops_with_its_name_and_the_problem(fn, problem):
    with pytest.raises(RewardError) as info:
        guarded(fn, "my_reward")(prompts=["p", "p"], completions=["a", "b"])
    assert str(info.value).startswith("reward 'my_reward' ") and problem in str(info.value)


def test_on_error_zero_scores_zero_and_warns_once():
    warnings = []
    reward = guarded(_raising, "my_reward", on_error="zero", warn=warnings.append)
    assert reward(prompts=["p"] * 3, completions=["a", "b", "c"]) == [0.0, 0.0, 0.0]
    assert reward(prompts=["p"], completions=["a"]) == [0.0]
    assert reward.failures == 2 and len(warnings) == 1
    assert "my_reward" in warnings[0] and "KeyError" in warnings[0] and "on_error: zero" in warnings[0]


def test_checked_scores_keep_the_name_trl_logs_and_accept_numpy_numbers():
    import numpy as np

    reward = guarded(_returning(lambda c: np.array([0.5, 1], dtype=np.float32)), "mine")
    assert reward.__name__ == "mine"
    assert reward(prompts=["p", "p"], completions=["a", "b"]) == [0.5, 1.0]


USER_REWARDS = '''
import re

def says_four(prompts, completions, **kwargs):
    """1.0 when the answer is 4."""
    return [1.0 if "4" in c[-1]["content"] else 0.0 for c in completions]

def fails_later(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 1:
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(completions)
'''


@pytest.fixture
def user_rewards(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_a_users_reward_file_is_loaded_probed_and_selectable_by_name(user_rewards, tmp_path, monkeypatch):
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.core.errors import ConfigError
    from lowvram_grpo.task.rewards import check_rewards, load_reward_module
    from lowvram_grpo.task.user_code import load as load_user_code

    config = load_config("tiny", [f"rewards.module={user_rewards}", "rewards.names=[says_four, brevity]"])
    assert config.rewards.module == str(user_rewards)
    # a relative path in a preset file is found beside the preset, and stored absolute in config.yaml
    preset = tmp_path / "mine.yaml"
    preset.write_text("model: {name: builtin:tiny}\nrewards: {module: my_rewards.py, names: [says_four]}\n")
    assert load_config(str(preset)).rewards.module == str(user_rewards)

    # probed: the run's check (rewards.check_rewards, in GRPORun's constructor) calls the user's function once,
    # on the first training row, with TRL's keywords
    rows = to_prompt_rows(load_questions(config.data)[0], config.data.system_prompt)
    module = load_reward_module(config.rewards.module)
    calls = []

    def says_four(prompts, completions, **kwargs):
        calls.append((prompts, completions, kwargs))
        return module_says_four(prompts, completions, **kwargs)

    module_says_four = module.says_four
    monkeypatch.setattr(module, "says_four", says_four)
    check_rewards(config.rewards, rows, "built-in problems")
    assert len(calls) == 1
    prompts, completions, kwargs = calls[0]
    assert prompts == [rows[0]["prompt"]] and len(completions) == 1 and completions[0][0]["role"] == "assistant"
    assert kwargs["answer"] == [rows[0]["answer"]] and kwargs["trainer_state"].global_step == 0
    assert {"completion_ids", "log_metric", "log_extra"} <= set(kwargs)
    monkeypatch.undo()

    # selectable by name: what TRL is handed, in order, under the names it logs, scoring as the file says
    says, brevity = load_user_code(run_plan(config)).reward_functions()
    assert (says.__name__, brevity.__name__) == ("says_four", "brevity")
    chat = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert says(prompts=["p", "p"], completions=[chat("<answer>4</answer>"), chat("<answer>5</answer>")]) == [1.0, 0.0]

    # a function the probe finds broken stops the run before anything heavy, with its name
    broken = tmp_path / "broken_rewards.py"
    broken.write_text("def says_four(prompts, completions, **kwargs):\n    return []\n")
    config = load_config("tiny", [f"rewards.module={broken}", "rewards.names=[says_four]"])
    with pytest.raises(ConfigError, match=r"reward 'says_four' returned 0 scores for 1 completion.*"
                                          r"called once on the first training row"):
        check_rewards(config.rewards, rows, "built-in problems")


def _tiny(tmp_path, *overrides):
    return load_config("tiny", ["train.max_steps=3", "eval.enabled=false", *overrides])


@pytest.mark.slow
def test_a_reward_failing_mid_run_stops_it_with_one_line_naming_it(user_rewards, tmp_path):
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--set", "eval.enabled=false", "--set", "train.save_steps=1",
                   "--set", f"rewards.module={user_rewards}", "--set", "rewards.names=[xmlcount, fails_later]",
                   "--output-dir", str(out), env=ENV)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "reward 'fails_later' raised ZeroDivisionError: division by zero" in errors[0]
    assert f"--resume {out}" in errors[0]  # checkpoint-1 was written before step 2 failed
    assert not (out / "adapter").exists()


@pytest.mark.slow
def test_on_error_zero_finishes_the_run_and_counts_the_failures(user_rewards, tmp_path, capsys):
    from lowvram_grpo.run.pipeline import run

    config = _tiny(tmp_path, f"rewards.module={user_rewards}", "rewards.names=[xmlcount, fails_later]",
                   "rewards.on_error=zero")
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["steps"] == 3
    assert result.summary["reward_failures"] == {"fails_later": 2}  # steps 2 and 3
    assert capsys.readouterr().err.count("warning: reward 'fails_later' raised ZeroDivisionError") == 1


def _blown_up_lora_a(config):
    """A model whose LoRA A matrices are ~1e29: the forward stays finite (B is 0), but the gradient of B
    overflows float32, as an fp16 overflow or a diverging run would."""
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve

    handle = load_model(resolve(config, detect(), "hf"))
    with torch.no_grad():
        for name, p in handle.model.named_parameters():
            if "lora_A" in name:
                p.mul_(1e30)
    return handle


@pytest.mark.slow
def test_nonfinite_gradients_skip_the_update_and_are_counted(tmp_path):
    from lowvram_grpo.run.pipeline import run

    config = _tiny(tmp_path, "train.max_nonfinite_steps=5")
    handle = _blown_up_lora_a(config)
    before = {n: p.detach().clone() for n, p in handle.model.named_parameters() if p.requires_grad}
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None, handle=handle)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in rows] == [1, 2, 3] and result.summary["skipped_nonfinite"] == 3
    assert all(r["grad_norm"] is None for r in rows)  # inf, stored as null
    after = dict(handle.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step must not move any weight"


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_stop_the_run_with_advice(tmp_path):
    from lowvram_grpo.run.pipeline import run

    config = _tiny(tmp_path, "train.max_nonfinite_steps=2")
    with pytest.raises(TrainingStopped, match=r"stopped at step 2 of 3: 2 steps in a row had a NaN/inf loss or gradient"
                                              r".*Lower train.learning_rate \(now 0.005\)"):
        run(config, tmp_path / "run", backend="hf", log=lambda *_: None, handle=_blown_up_lora_a(config))
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.slow
def test_a_learning_rate_that_blows_the_weights_up_ends_in_one_clear_line(tmp_path):
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--set", "eval.enabled=false",
                   "--set", "train.learning_rate=1e30", "--output-dir", str(tmp_path / "run"), env=ENV)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "outputs are NaN/inf" in errors[0] and "Lower train.learning_rate (now 1e+30)" in errors[0]
