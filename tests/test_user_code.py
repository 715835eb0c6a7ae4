"""The user's code is loaded once per run (user_code.py): in one real tiny run with a tools file, an environment
file, a reward file, priming, GRPO and held-out measurements with tools, each file is imported once and each name
in rewards.names / tools.names / environment.name is turned into its function once.

The counts are taken by wrapping (not replacing: each wrapper calls the real function) the package's functions that
import a user's file (user_files.import_user_file) and that turn a name into a callable (rewards.lookup_reward,
tools.lookup_tool, tools.environment_class), in every module that holds them."""
import collections
import sys

import pytest

from lowvram_grpo.settings.config import load_config
from tool_transcripts import ENVIRONMENT_FILE

pytestmark = pytest.mark.slow

TOOLS_FILE = '''
def shout(word: str) -> str:
    """Say a word louder.

    Args:
        word: The word to say.
    """
    return word.upper()
'''

REWARDS_FILE = '''
def says_something(prompts, completions, **kwargs):
    return [float(len(str(c)) > 0) for c in completions]
'''


def _count(monkeypatch, counts, module_name, attr, key):
    import importlib

    original = getattr(importlib.import_module(module_name), attr)

    def counted(*args, **kwargs):
        counts[key(*args, **kwargs)] += 1
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):  # every module that bound the function by name
        if name.startswith("lowvram_grpo") and getattr(module, attr, None) is original:
            monkeypatch.setattr(module, attr, counted)


def test_one_run_loads_each_user_file_and_looks_up_each_name_once(tmp_path, monkeypatch):
    from lowvram_grpo.settings import checks
    from lowvram_grpo.evaluate import evaluation
    from lowvram_grpo.run import pipeline
    from lowvram_grpo.training import priming
    from lowvram_grpo.task import rewards
    from lowvram_grpo.evaluate import tool_turns
    from lowvram_grpo.task import tools
    from lowvram_grpo.training import grpo as training
    from lowvram_grpo.task import user_code  # noqa: F401
    from lowvram_grpo.run.pipeline import run

    (tmp_path / "my_tools.py").write_text(TOOLS_FILE)
    (tmp_path / "my_env.py").write_text(ENVIRONMENT_FILE)
    (tmp_path / "my_rewards.py").write_text(REWARDS_FILE)
    counts = collections.Counter()
    _count(monkeypatch, counts, "lowvram_grpo.task.user_files", "import_user_file",
           lambda path, setting, *a, **k: ("file", setting))
    _count(monkeypatch, counts, "lowvram_grpo.task.rewards", "lookup_reward", lambda name, *a, **k: ("reward", name))
    _count(monkeypatch, counts, "lowvram_grpo.task.tools", "lookup_tool", lambda name, *a, **k: ("tool", name))
    _count(monkeypatch, counts, "lowvram_grpo.task.tools", "environment_class", lambda name, *a: ("environment", name))
    config = load_config("tiny", [
        "train.max_steps=2", "prime.steps=1", "data.eval_size=2", "eval.batch_size=2", "train.max_prompt_length=1400",
        "model.max_seq_length=1500", "train.max_completion_length=32", "tools.max_turns=1",
        f"tools.module={tmp_path / 'my_tools.py'}", "tools.names=[calculator, shout]",
        f"environment.module={tmp_path / 'my_env.py'}", "environment.name=Shop",
        f"rewards.module={tmp_path / 'my_rewards.py'}", "rewards.names=[says_something, correctness]"])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["status"] == "complete" and result.summary["steps"] == 2
    assert result.summary["primed"] is not None and result.summary["after"] is not None  # every phase ran
    assert dict(counts) == {("file", "tools.module"): 1, ("file", "environment.module"): 1,
                            ("file", "rewards.module"): 1,
                            ("reward", "says_something"): 1, ("reward", "correctness"): 1,
                            ("tool", "calculator"): 1, ("tool", "shout"): 1, ("environment", "Shop"): 1}, dict(counts)
