"""trl_compat: the one module that reaches into TRL/transformers internals checks, at import, that they
are what it was written for, and says what to do when they are not."""
import pytest

from lowvram_grpo.training import trl_compat
from lowvram_grpo.run.errors import BackendError


def test_the_pinned_versions_pass_silently():
    said = []
    assert trl_compat.check_versions(warn=said.append) == [] and said == []


def test_another_version_with_the_same_hooks_warns_once(monkeypatch):
    monkeypatch.setattr(trl_compat.trl, "__version__", "1.16.0")
    said = []
    trl_compat.check_versions(warn=said.append)
    assert len(said) == 1 and "written for trl==1.15.0" in said[0] and "found trl 1.16.0" in said[0]


def test_a_missing_hook_is_an_error_with_the_fix(monkeypatch):
    monkeypatch.delattr(trl_compat.Trainer, "_get_grad_norm")
    with pytest.raises(BackendError, match=r"Trainer\._get_grad_norm\(model, grad_norm\).*pip install trl==1\.15\.0 transformers==5\.17\.0"):
        trl_compat.check_versions()


def test_a_changed_hook_signature_is_an_error(monkeypatch):
    monkeypatch.setattr(trl_compat.Trainer, "_save_checkpoint", lambda self, model: None)
    with pytest.raises(BackendError, match=r"_save_checkpoint\(model, trial\)"):
        trl_compat.check_versions()


def test_private_reaches_live_only_here():
    """No other module overrides a private Trainer method, swaps TRL's log-prob kernel or names one of
    GRPOTrainer's private rollout methods."""
    import re
    from pathlib import Path

    package = Path(trl_compat.__file__).parent
    pattern = re.compile(r"def (_save_checkpoint|_get_output_dir|_get_grad_norm|_load_from_checkpoint)\b|_ChunkedLogProbFunction\s*="
                         r"|\.(use_vllm|vllm_generation|_last_loaded_step)\s*=[^=]"
                         r"|[\"'](_generate_and_score_completions|_generate|_generate_single_turn)[\"']")
    offenders = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                       if p.name != "trl_compat.py" and pattern.search(p.read_text()))
    assert offenders == []


def test_the_rollout_methods_oom_phase_names_are_trls_own(monkeypatch):
    """oom.oom_phase tells a rollout's out-of-memory by these names (tests/test_memory.py raises inside
    them): each is a method TRL's GRPOTrainer defines, and a TRL without one is refused with the fix."""
    import trl

    assert trl_compat.TRL_ROLLOUT_METHODS == ("_generate_and_score_completions", "_generate", "_generate_single_turn")
    for name in trl_compat.TRL_ROLLOUT_METHODS:
        assert callable(vars(trl.GRPOTrainer).get(name)), name
    assert trl_compat.missing_rollout_methods(trl.GRPOTrainer) == []
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")  # as a TRL that renamed it
    assert trl_compat.missing_rollout_methods(trl.GRPOTrainer) == ["GRPOTrainer._generate_single_turn"]
    with pytest.raises(BackendError, match=r"GRPOTrainer\._generate_single_turn.*pip install trl==1\.15\.0"):
        trl_compat.check_versions()


def test_the_model_sampler_calls_trls_single_turn_as_trl_defines_it(monkeypatch):
    """trl_compat.ModelSampler (the correction for the model's own rollouts) calls GRPOTrainer._generate_single_turn
    with TRL 1.15's parameters; a TRL whose method takes others is refused with the fix."""
    import trl

    assert trl_compat.missing_single_turn(trl.GRPOTrainer) == []
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", lambda self, prompt_ids, num_generations: None)
    assert trl_compat.missing_single_turn(trl.GRPOTrainer) == [
        "GRPOTrainer._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)"]
    with pytest.raises(BackendError, match=r"_generate_single_turn\(prompt_ids, images.*pip install trl==1\.15\.0"):
        trl_compat.check_versions()
