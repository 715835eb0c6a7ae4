"""The run's plan (plans.run_plan) is built once per run, by the pipeline, and every check and resolve read that one
(issue 67): counted on a real tiny run through `train()`, the way the notebook and Python users call it. So is the
model's shape (model_shapes.model_shape): derived once, with the plan (plan.model.facts), and read from there by the
checks, resolve's step-time estimate and the memory plan."""
from __future__ import annotations

import sys

import pytest


def _count_calls(monkeypatch, module, attr: str, label) -> list:
    """Every module of the package bound to `module.attr` (`module` itself included, so a lazy `from ... import` is
    seen too) gets a counting wrapper; the list grows `label(first argument)` at each call."""
    import lowvram_grpo.run.pipeline  # noqa: F401  (loads every module a run binds it in)

    calls, original = [], getattr(module, attr)

    def counted(first, *args, **kwargs):
        calls.append(label(first))
        return original(first, *args, **kwargs)

    for name, bound in list(sys.modules.items()):
        if name.startswith("lowvram_grpo") and getattr(bound, attr, None) is original:
            monkeypatch.setattr(bound, attr, counted)
    return calls


def _count_run_plan(monkeypatch) -> list:
    """plans.run_plan's calls, by the config's preset."""
    from lowvram_grpo.settings import plans

    return _count_calls(monkeypatch, plans, "run_plan", lambda config: config.preset)


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


def _count_model_shape(monkeypatch) -> list:
    """model_shapes.model_shape's calls, by model name."""
    from lowvram_grpo.settings import model_shapes

    return _count_calls(monkeypatch, model_shapes, "model_shape", lambda name: name)


@pytest.mark.slow
def test_the_model_shape_is_derived_once_per_run(tmp_path, monkeypatch):
    from lowvram_grpo import train

    calls = _count_model_shape(monkeypatch)
    train("tiny", ["train.max_steps=1", "prime.steps=0", "eval.enabled=false"], output_dir=str(tmp_path / "run"))
    assert calls == ["builtin:tiny"], f"the model's shape derived {len(calls)} times in one run"


def test_the_checks_and_resolve_read_the_plans_shape(monkeypatch):
    """What the pipeline does before the model loads, on a GPU card (the memory plan and its suggestions too): the
    plan built once derives the shape once; before_load, resolve and the memory plan read it."""
    from lowvram_grpo.settings import checks
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.memory_plan import plan
    from lowvram_grpo.settings.plans import run_plan
    from lowvram_grpo.settings.resolve import resolve

    calls = _count_model_shape(monkeypatch)
    config = load_config("tiny", ["model.fast_inference=false", "memory.vram_gb=0.5", "train.num_generations=16"])
    run = run_plan(config)
    checks.before_load(config, run)
    resolved = resolve(config, profile("t4"), "hf", plan=run)
    assert calls == ["builtin:tiny"], f"the model's shape derived {len(calls)} times by the checks and resolve"
    planned = plan(config, resolved)
    # too small a card: plan() searched settings that fit, re-resolving changed settings of the one model
    assert planned.fits is False and "even with memory.gradient_checkpointing=unsloth" in planned.no_fit_reason
    assert calls == ["builtin:tiny"], f"the model's shape derived {len(calls)} times"
