"""The CI stages that must run cannot pass by skipping (issue 34 §2): LOWVRAM_GRPO_NO_SKIPS=1, set by .ci/run's
vLLM CPU stage, turns every skip, a module's `pytest.importorskip` at collection included, into a failure."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import NO_SKIPS_ENV, REPO

SKIPPING = '''
import pytest
pytest.importorskip("lowvram_grpo_no_such_module", reason="the extra is not installed")

def test_never_reached():
    pass
'''
SKIPPING_TEST = '''
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("no engine here")
'''


def _pytest(folder: Path, no_skips: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != NO_SKIPS_ENV}
    if no_skips:
        env[NO_SKIPS_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), env.get("PYTHONPATH", "")])
    # the suite's conftest (tests/conftest.py) as a plugin, on files of a folder of their own
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), "-c", os.devnull, str(folder)],
                          cwd=folder, capture_output=True, text=True, timeout=300, env=env)


def test_a_stage_that_must_run_fails_on_a_skip(tmp_path):
    """A module skipped at collection (a vLLM extra that does not import) and a test that skips: both pass
    as skips normally, both fail under LOWVRAM_GRPO_NO_SKIPS=1 (before: the stage passed, 0 failures)."""
    for name, text, reason in (("module", SKIPPING, "the extra is not installed"),
                               ("test", SKIPPING_TEST, "no engine here")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"test_{name}_skip.py").write_text(text)
        (folder / "test_other.py").write_text("def test_passes():\n    pass\n")  # as test_vllm_choice.py beside it
        plain = _pytest(folder, no_skips=False)
        assert plain.returncode == 0 and "skipped" in plain.stdout and reason in plain.stdout, plain.stdout[-2000:]
        strict = _pytest(folder, no_skips=True)
        out = strict.stdout
        assert strict.returncode != 0, out[-2000:]
        assert f"skipped under {NO_SKIPS_ENV}=1 (a stage that must run)" in out and reason in out, out[-2000:]


def test_ci_runs_the_vllm_stage_with_skips_as_failures():
    """.ci/run's vLLM CPU stage (from the extra's install to its `deactivate`) runs every pytest under
    LOWVRAM_GRPO_NO_SKIPS=1, and its two halves side by side split the same files by one -k expression and its
    negation, so every test of them runs in exactly one half."""
    text = (REPO / ".ci" / "run").read_text()
    start = text.index('echo "ci: vLLM CPU extra')
    stage = text[start:text.index("\ndeactivate\n", start)]
    runs = [line for line in stage.splitlines() if "python -m pytest" in line]
    assert len(runs) == 3 and all(line.lstrip("( ").startswith(f"{NO_SKIPS_ENV}=1 ") for line in runs), runs
    assert stage.count('"${VLLM_FILES[@]}" -k "$HALF"') == 1 and stage.count('"${VLLM_FILES[@]}" -k "not ($HALF)"') == 1
    assert "VLLM_FILES=(tests/test_vllm_engine.py tests/test_vllm_choice.py)" in stage
    assert "tests/test_adapter_guard.py -k vllm" in stage
