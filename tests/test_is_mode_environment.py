"""UNSLOTH_GRPO_VLLM_IS_MODE (issue 65, defect 5): unsloth_zoo's GRPO loss reads it over the config's mode, so the run
sets it to the mode resolve decided, but only while GRPO trains with unsloth's vLLM engine started, and puts back
what was there after (a notebook that trains again without vLLM, or a load that fails, does not keep it)."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from lowvram_grpo.settings.resolve import IS_MODE_ENV

pytestmark = pytest.mark.slow  # unsloth's load and a real run (pytest.ini: the fast tier is -m "not slow")


def test_a_load_that_does_not_start_the_engine_leaves_the_variable_alone():
    """unsloth's load with fast_inference asked for and no engine (here the CPU loader refuses vLLM, as a card whose
    start fails would): the IS mode of the settings that wanted the engine is not in the environment afterwards.
    Before the fix load_model set it before from_pretrained, and it stayed set."""
    script = textwrap.dedent(f"""
        import dataclasses, os
        from lowvram_grpo.model.backends import load_model, prepare_backend
        from lowvram_grpo.settings.config import load_config
        from lowvram_grpo.settings.hardware import detect
        from lowvram_grpo.settings.resolve import resolve
        prepare_backend("unsloth")
        r = resolve(load_config("tiny", []), detect(), "unsloth")
        r = dataclasses.replace(r, generation="unsloth_vllm", is_correction=True, is_mode="sequence_mask")
        assert r.trainer_environment == {{"{IS_MODE_ENV}": "sequence_mask"}}
        try:
            load_model(r, log=lambda *a: None)
            print("loaded")
        except Exception as exc:
            print("failed:", type(exc).__name__)
        print("variable:", os.environ.get("{IS_MODE_ENV}"))
    """)
    env = {k: v for k, v in os.environ.items() if k != IS_MODE_ENV}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "failed: NotImplementedError" in lines  # unsloth's CPU loader: "fast_inference (vLLM) needs a GPU"
    assert lines[-1] == "variable: None"


def test_the_trainer_sets_the_variable_while_it_trains_and_restores_it(tmp_path, tiny_model_dir, monkeypatch):
    """RunTrainer.train puts the settings' trainer_environment in place for GRPO (a reward function sees it during
    the step) and restores the shell's own value after; the settings of a run without unsloth's engine have none."""
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    config = load_config("tiny", ["train.max_steps=1", "rewards.names=[xmlcount]"])  # one weight: the watcher's
    handle = load_model(resolve(config, detect(), "hf"))
    seen = []

    def watch(prompts, completions, **kwargs):
        seen.append(os.environ.get(IS_MODE_ENV))
        return [0.0] * len(completions)

    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q[:8], config.data.system_prompt), tmp_path,
                            reward_funcs=[watch])
    assert trainer.run_environment == handle.resolved.trainer_environment == {}  # no unsloth engine: nothing set
    trainer.run_environment = {IS_MODE_ENV: "token_truncate"}  # what an engine-started unsloth run's settings give
    monkeypatch.setenv(IS_MODE_ENV, "left-in-the-shell")
    trainer.train()
    assert seen and set(seen) == {"token_truncate"}
    assert os.environ[IS_MODE_ENV] == "left-in-the-shell"
    monkeypatch.delenv(IS_MODE_ENV)
    seen.clear()
    trainer.args.max_steps = 2
    trainer.train()
    assert set(seen) == {"token_truncate"} and IS_MODE_ENV not in os.environ
