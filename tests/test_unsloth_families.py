"""The tiny families (tests/tiny_families.py) through unsloth's patched `UnslothGRPOTrainer`, the trainer every GPU
run uses, on unsloth 2026.10.9's CPU path (GPU install set): each family unsloth's CPU path loads is measured before,
trained 2 GRPO steps, measured after, and its adapter saved, loaded and generated with (save_lora / load_lora /
fast_generate), one family after another in one Python process. Every family of tiny_families loads there (qwen3,
qwen3_5, gemma3, gemma4, llama, gpt_oss, smollm3: none is excluded).

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

# Every family in one process, one after another, as a notebook's kernel loads model after model: unsloth imported
# and its trainer generated once (~25 s of each of the seven processes this module started before, 401 s in all on
# an AVX2-only EPYC). A family that fails prints its error and the next one runs.
RUN = textwrap.dedent("""
    import json, sys, traceback
    sys.path.insert(0, {tests!r})
    from tiny_families import FAMILIES, build
    from lowvram_grpo import train
    for family in FAMILIES:
        out = sys.argv[1] + "/" + family
        try:
            sets = [f"model.name={{build(family)}}", f"lora.target_modules=[{{','.join(FAMILIES[family][2])}}]",
                    "train.max_steps=2", "train.num_generations=2", "train.max_completion_length=8",
                    "data.eval_size=2", "eval.batch_size=2", "data.num_train=16", "train.max_prompt_length=384"]
            result = train("tiny", sets, output_dir=out, backend="unsloth")
            handle = result.handle
            request = handle.load_lora(handle.save_lora(out + "-saved"))
            texts = handle.fast_generate([[{{"role": "user", "content": "What is 7 * 8?"}}]], lora_request=request)
            print("RESULT", family, json.dumps({{"summary": result.summary, "generated": [str(t) for t in texts]}}),
                  flush=True)
        except Exception:
            print("FAILED", family, json.dumps(traceback.format_exc()), flush=True)
""").format(tests=str(REPO / "tests"))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: its RESULT or FAILED line's JSON}, and the process (its output for a failure's message)."""
    root = tmp_path_factory.mktemp("families")
    proc = subprocess.run([sys.executable, "-c", RUN, str(root / "runs")], cwd=root, capture_output=True, text=True,
                          timeout=3000, env=_env())
    lines = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("RESULT", "FAILED"):
            family, _, payload = rest.partition(" ")
            lines[family] = (word, json.loads(payload))
    return lines, proc


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_through_unsloths_patched_trainer(family, families):
    lines, proc = families
    assert family in lines, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    word, result = lines[family]
    assert word == "RESULT", result
    summary = result["summary"]
    assert summary["grpo_settings"]["trainer"] == "UnslothGRPOTrainer"
    assert summary["status"] == "complete" and summary["steps"] == 2
    assert summary["before"]["n"] == summary["after"]["n"] == 2
    assert len(result["generated"]) == 1
