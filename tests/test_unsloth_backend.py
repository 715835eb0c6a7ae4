"""The unsloth backend, for real, in its own process: unsloth must be imported before trl and
transformers, and it patches them, so it never shares a process with the hf-backend tests.
On this CPU machine unsloth runs its own CPU backend (same FastLanguageModel calls, no vLLM)."""
import importlib.util
import json

import pytest
from safetensors.torch import load_file

from conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                                reason="unsloth is not installed (pip install -r requirements-cpu.txt installs it)")]


def test_unsloth_backend_trains_the_tiny_model_for_two_steps(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--backend", "unsloth", "--export", "merged16",
                   "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unsloth" in proc.stdout + proc.stderr  # unsloth itself announced its backend
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "unsloth" and summary["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())
    _check_merged_export(out / "export-merged16", out / "adapter")


def _check_merged_export(exported, adapter):
    """--export merged16 went through unsloth's save_pretrained_merged: a plain 16-bit checkpoint whose
    weights are base + adapter, as PEFT merges them (checked here with transformers + peft, without unsloth)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert not hasattr(merged, "peft_config") and merged.dtype.itemsize == 2
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path).state_dict()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path),
                                          adapter).merge_and_unload().state_dict()
    export_error = max((merged.state_dict()[k].float() - w).abs().max().item() for k, w in reference.items())
    adapter_effect = max((w - base[k]).abs().max().item() for k, w in reference.items())
    assert export_error < adapter_effect / 4  # 16-bit rounding, well below what training changed


def test_unsloth_is_imported_only_by_the_backend_module():
    import re
    from pathlib import Path

    statement = re.compile(r"^\s*(import unsloth|from unsloth)", re.MULTILINE)
    package = Path(__file__).resolve().parent.parent / "lowvram_grpo"
    importers = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                       if statement.search(p.read_text()))
    assert importers == ["model/unsloth_backend.py"]


def test_choosing_a_backend_imports_neither_trl_nor_transformers():
    """The CLI picks (and for unsloth, imports) the backend before trl/transformers load."""
    import subprocess
    import sys

    code = ("import sys; import lowvram_grpo.run.pipeline, lowvram_grpo.run.cli, lowvram_grpo.settings.config as c; "
            "from lowvram_grpo.settings.resolve import resolve; from lowvram_grpo.settings.hardware import detect; "
            "resolve(c.load_config('tiny'), detect()); "
            "bad = [m for m in ('trl', 'transformers', 'peft', 'unsloth') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(__import__('pathlib').Path(__file__).resolve().parent.parent))
    assert proc.returncode == 0, proc.stderr[-2000:]
