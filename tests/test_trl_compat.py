"""trl_compat: the one module that reaches into TRL/transformers internals checks, at import, that they
are what it was written for, and says what to do when they are not."""
import pytest

from lowvram_grpo import trl_compat
from lowvram_grpo.errors import BackendError


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
    """No other module overrides a private Trainer method or swaps TRL's log-prob kernel."""
    import re
    from pathlib import Path

    package = Path(trl_compat.__file__).parent
    pattern = re.compile(r"def (_save_checkpoint|_get_output_dir|_get_grad_norm|_load_from_checkpoint)\b|_ChunkedLogProbFunction\s*="
                         r"|\.(use_vllm|vllm_generation|_last_loaded_step)\s*=[^=]")
    offenders = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                       if p.name != "trl_compat.py" and pattern.search(p.read_text()))
    assert offenders == []
