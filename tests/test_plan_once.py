"""The run's plan (plans.run_plan) is built once per run, by the pipeline, and every check and resolve read that one
(issue 67): counted on a real tiny run through `train()`, the way the notebook and Python users call it."""
from __future__ import annotations

import sys

import pytest


def _count_run_plan(monkeypatch) -> list:
    """Every module of the package bound to plans.run_plan gets a counting wrapper; the list grows a call each."""
    import lowvram_grpo.run.pipeline  # noqa: F401  (loads every module a run binds run_plan in)
    from lowvram_grpo.settings import plans

    calls, original = [], plans.run_plan

    def counted(config):
        calls.append(config.preset)
        return original(config)

    for name, module in list(sys.modules.items()):
        if name.startswith("lowvram_grpo") and getattr(module, "run_plan", None) is original:
            monkeypatch.setattr(module, "run_plan", counted)
    return calls


@pytest.mark.slow
def test_run_plan_is_built_once_per_run(tmp_path, monkeypatch):
    from lowvram_grpo import train

    calls = _count_run_plan(monkeypatch)
    train("tiny", ["train.max_steps=1", "prime.steps=0", "eval.enabled=false"], output_dir=str(tmp_path / "run"))
    assert calls == ["tiny"], f"run_plan built {len(calls)} times in one run"


def test_the_count_sees_a_second_build(monkeypatch):
    """The counter is bound where the checks look the plan up: a check handed no plan builds its own, and is seen."""
    from lowvram_grpo.settings import checks
    from lowvram_grpo.settings.config import load_config

    calls = _count_run_plan(monkeypatch)
    checks.before_load(load_config("tiny", []))
    assert calls == ["tiny"]
