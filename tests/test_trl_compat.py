"""trl_compat: the one module that reaches into TRL/transformers internals checks, at import, that they
are what it was written for, and says what to do when they are not."""
import ast
from pathlib import Path

import pytest
from transformers import GenerationConfig

from lowvram_grpo.core import internals
from lowvram_grpo.training import trl_compat
from lowvram_grpo.core.errors import BackendError


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
    with pytest.raises(BackendError, match=r"Trainer\._get_grad_norm\(model, grad_norm\)"
                                           r".*pip install trl==1\.15\.0 transformers==5\.17\.0"):
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

    package = Path(trl_compat.__file__).parents[1]  # the whole package, every room
    pattern = re.compile(r"def (_save_checkpoint|_get_output_dir|_get_grad_norm|_load_from_checkpoint)\b"
                         r"|_ChunkedLogProbFunction\s*="
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


# --------------------------------------------------------------------------- the doors (issue 50)
# The modules through which every reach into an upstream object's private names, and every change to a built trainer,
# goes: trl_compat (TRL's trainer and transformers.Trainer) and core.internals (transformers' and PEFT's generation,
# torch's machine facts, unsloth's float32 mark, our marks on models and layers). Everywhere else a `_` attribute is
# only ever `self`'s or `cls`'s (or super()'s), and a trainer is assembled in its own constructor (training.grpo.
# RunTrainer.__init__, on `self`).
DOORS = ("lowvram_grpo/training/trl_compat.py", "lowvram_grpo/core/internals.py")
TRAINER_CALLBACK_METHODS = {"add_callback", "remove_callback", "pop_callback"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node) -> bool:
    """`self`, `cls` or `super()`: the object whose code this is."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _is_trainer(node) -> bool:
    """An expression naming a trainer (`trainer`, `self.trainer`, `run.trainer.state` ...), `self` itself excluded."""
    return not _own(node) and "trainer" in ast.unparse(node).lower()


def door_violations(source: str) -> list[str]:
    """'line N: what' for each reach outside a door: an attribute (or a getattr/setattr/hasattr/delattr name, or an
    imported name) beginning with `_` of anything but self/cls/super(); an attribute set or deleted on a trainer, by
    assignment or setattr; a trainer's callback list touched (add/remove/pop_callback, its callback_handler)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            if _private(node.attr) and not _own(node.value):
                found.append(f"line {line}: {ast.unparse(node)}")
            elif node.attr == "callback_handler" and not _own(node.value):
                found.append(f"line {line}: {ast.unparse(node)}")
            elif node.attr in TRAINER_CALLBACK_METHODS and not _own(node.value):
                found.append(f"line {line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value) \
                        and not _own(node.args[0]):
                    found.append(f"line {line}: {ast.unparse(node)}")
            if node.func.id in ("setattr", "delattr") and _is_trainer(node.args[0]):
                found.append(f"line {line}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"line {line}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and _is_trainer(sub.value):
                        found.append(f"line {line}: {ast.unparse(sub)} set on a built trainer")
    return sorted(set(found), key=lambda s: (int(s.split(":")[0].split()[1]), s))


def test_the_ratio_from_the_loss_reads_trls_own_lines(monkeypatch):
    """trl_compat.RatioFromLoss mirrors TRL 1.15's importance-sampling ratio and relies on its loss calling
    _get_per_token_logps_and_entropies before multiplying by inputs["importance_sampling_ratio"]: check_versions
    reads those lines in the installed GRPOTrainer (RATIO_SOURCE), and a TRL whose loss no longer has them is
    refused."""
    import trl

    assert trl_compat.missing_ratio_hooks(trl.GRPOTrainer) == []
    original = trl.GRPOTrainer._compute_loss

    def _compute_loss(self, model, inputs):  # as a TRL whose loss applies the ratio elsewhere
        return original(self, model, inputs)

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", _compute_loss)
    missing = trl_compat.missing_ratio_hooks(trl.GRPOTrainer)
    assert missing == [f"GRPOTrainer._compute_loss: {line}" for line in trl_compat.RATIO_SOURCE["_compute_loss"]]
    with pytest.raises(BackendError, match=r"GRPOTrainer\._compute_loss: per_token_logps.*pip install trl==1\.15\.0"):
        trl_compat.check_versions()
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", lambda self, model, input_ids: None)
    assert ("GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)"
            in trl_compat.missing_ratio_hooks(trl.GRPOTrainer))


def test_private_reaches_go_through_the_doors():
    planted = ("import torch\n\n\nclass T:\n    def f(self):\n        self._x = 1\n        return super()._y()\n\n\n"
               "def g(model, trainer):\n    model._lowvram_decode = 1\n    getattr(model, '_tag', None)\n"
               "    torch._C._cuda_getDriverVersion()\n    trainer.run_dir = 'x'\n"
               "    trainer.callback_handler.callbacks\n"
               "    trainer.add_callback(None)\n    setattr(trainer, 'validation', None)\n"
               "    from lowvram_grpo.model.vllm.engine import _OPEN\n    return model.__class__\n")
    assert door_violations(planted) == [
        "line 11: model._lowvram_decode", "line 12: getattr(model, '_tag', None)", "line 13: torch._C",
        "line 13: torch._C._cuda_getDriverVersion", "line 14: trainer.run_dir set on a built trainer",
        "line 15: trainer.callback_handler", "line 16: trainer.add_callback",
        "line 17: setattr(trainer, 'validation', None)", "line 18: from lowvram_grpo.model.vllm.engine import _OPEN"]
    package = Path(trl_compat.__file__).parents[1]
    found = {path.relative_to(package.parent).as_posix(): bad for path in sorted(package.rglob("*.py"))
             if path.relative_to(package.parent).as_posix() not in DOORS and (bad := door_violations(path.read_text()))}
    assert not found, f"reach these through a door ({', '.join(DOORS)}), or build the trainer with them: {found}"


def test_the_internals_door_finds_every_reach_in_the_pinned_wheels(monkeypatch):
    assert internals.missing_reaches() == []
    monkeypatch.delattr(GenerationConfig, "_get_default_generation_params")
    assert internals.missing_reaches() == [
        "transformers.generation.configuration_utils.GenerationConfig._get_default_generation_params"]
    with pytest.raises(BackendError,
                       match=r"_get_default_generation_params.*pip install transformers==5\.17\.0 peft==0\.21\.2"):
        internals.default_generation_params(GenerationConfig())


def test_the_sampling_settings_are_read_through_the_door():
    """TRL's GRPOTrainer sets every attribute our vLLM rollouts sample with (read from the pinned TRL's source), a
    trainer class that no longer sets one is named, and vllm_rollouts reaches none of them but through the door."""
    import trl

    assert trl_compat.missing_sampling_attributes(trl.GRPOTrainer) == []

    class Renamed:
        def __init__(self):
            self.top_p = self.top_k = self.min_p = self.repetition_penalty = 1
            self.eos_token_ids = self.max_completion_length = 1
            self.sampling_temperature = 1.0

    assert trl_compat.missing_sampling_attributes(Renamed) == ["Renamed.temperature"]
    source = (Path(trl_compat.__file__).parent / "vllm_rollouts.py").read_text()
    reads = sorted({node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name) and node.value.id == "trainer"
                    and node.attr in trl_compat.SAMPLING_ATTRIBUTES})
    assert reads == [], f"read through trl_compat.sampling_settings: {reads}"
