"""The tiny families (tests/tiny_families.py) through unsloth's patched `UnslothGRPOTrainer`, the trainer every GPU
run uses, on unsloth 2026.10.9's CPU path (GPU install set): each family unsloth's CPU path loads is measured before,
trained 2 GRPO steps, measured after, and its adapter saved, loaded and generated with (save_lora / load_lora /
fast_generate). Every family of tiny_families loads there (qwen3, qwen3_5, gemma3, gemma4, llama, gpt_oss, smollm3:
none is excluded).

Runs in CI's GPU-set stage (its gating is test_unsloth_trainer's: the module is skipped outside the GPU install set,
and fails there rather than skipping under LOWVRAM_GRPO_GPU_SET=1)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from test_unsloth_trainer import _env  # also its gating: skipped outside the GPU install set
from tiny_families import FAMILIES

pytestmark = pytest.mark.slow

RUN = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from tiny_families import FAMILIES, build
    from lowvram_grpo import train
    family = sys.argv[1]
    sets = [f"model.name={{build(family)}}", f"lora.target_modules=[{{','.join(FAMILIES[family][2])}}]",
            "train.max_steps=2", "train.num_generations=2", "train.max_completion_length=8", "data.eval_size=2",
            "eval.batch_size=2", "data.num_train=16", "train.max_prompt_length=384"]
    result = train("tiny", sets, output_dir=sys.argv[2], backend="unsloth")
    handle = result.handle
    request = handle.load_lora(handle.save_lora(sys.argv[2] + "-saved"))
    texts = handle.fast_generate([[{{"role": "user", "content": "What is 7 * 8?"}}]], lora_request=request)
    print("RESULT", json.dumps({{"summary": result.summary, "generated": [str(t) for t in texts]}}))
""").format(tests=str(REPO / "tests"))


def _run(family: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN, family, str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500, env=_env())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_through_unsloths_patched_trainer(family, tmp_path):
    proc = _run(family, tmp_path)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads(results[-1][len("RESULT "):])
    summary = result["summary"]
    assert summary["grpo_settings"]["trainer"] == "UnslothGRPOTrainer"
    assert summary["status"] == "complete" and summary["steps"] == 2
    assert summary["before"]["n"] == summary["after"]["n"] == 2
    assert len(result["generated"]) == 1

