"""Starting a run from a saved adapter (--init-adapter / lora.init_adapter), ours or another tool's: its
r / alpha / targets come from adapter_config.json, it is the trainable LoRA on both backends, another base
model is refused before loading, priming is skipped unless asked, and `--resume` of a finished run prints
the command that trains on from it (run here as printed)."""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.core.errors import AdapterError, ConfigError

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

ENV = {"OMP_NUM_THREADS": "1"}


def test_resume_of_a_finished_run_says_how_to_train_on_and_that_command_trains_from_its_adapter(tiny_run, tmp_path):
    source = tmp_path / "run"
    shutil.copytree(tiny_run[0], source)
    refused = run_cli("--resume", str(source), env=ENV)
    assert refused.returncode == 2, refused.stderr[-2000:]
    error = refused.stderr.strip().splitlines()[-1]
    command = error.split("to train on from its adapter: ")[1]
    assert command == (f"python -m lowvram_grpo.run --preset {source}/config.yaml --init-adapter {source}/adapter "
                       f"--output-dir {source}-more")
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = Path(f"{source}-more")
    summary, before = (json.loads((d / "summary.json").read_text()) for d in (new, source))
    assert summary["status"] == "complete" and summary["steps"] == 3
    assert summary["init_adapter"] == str(source / "adapter")
    assert summary["before"] == before["after"]  # "before" is the adapter the run started from, measured the same way
    assert f"starting from the adapter in {source / 'adapter'} (r=8, alpha=16" in proc.stdout
    assert "no priming: the run starts from the adapter" in proc.stdout
    start, trained = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (source, new))
    assert start.keys() == trained.keys() and all(start[k].shape == trained[k].shape for k in start)
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # and GRPO trained on from there
    config = (new / "config.yaml").read_text()
    assert f"init_adapter: {source / 'adapter'}" in config and "steps: 0" in config


def _other_tools_adapter(folder: Path, tiny_model_dir, base=None, **lora) -> Path:
    """An adapter as plain PEFT (any tool built on it) saves one, with settings unlike the preset's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base or tiny_model_dir)
    settings = dict(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"], use_rslora=True, lora_dropout=0.05, **lora)
    peft_model = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():  # as if trained: lora_B is 0 in a fresh adapter
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    peft_model.save_pretrained(folder)
    return folder


def _loaded_matches(handle, adapter: Path) -> None:
    from peft import get_peft_model_state_dict
    from peft.utils import load_peft_weights

    saved = load_peft_weights(str(adapter), device="cpu")
    live = get_peft_model_state_dict(handle.model)
    assert saved.keys() == live.keys()
    assert all(torch.equal(saved[k], live[k].cpu()) for k in saved)
    trainable = [n for n, p in handle.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert handle.trainable_parameters() == sum(v.numel() for v in saved.values())


def test_another_tools_adapter_is_the_trainable_lora_with_its_own_settings(tmp_path, tiny_model_dir):
    adapter = _other_tools_adapter(tmp_path / "theirs", tiny_model_dir)
    config = load_config("tiny", [f"lora.init_adapter={adapter}", "train.max_steps=1"])
    assert (config.lora.r, config.lora.alpha, config.lora.target_modules,
            config.lora.dropout) == (4, 12, ["q_proj", "v_proj"], 0.05)
    from lowvram_grpo.run.pipeline import GRPORun

    grpo = GRPORun(config, tmp_path / "out", backend="hf", log=lambda *a: None)
    try:
        handle = grpo.load()
        _loaded_matches(handle, adapter)
        assert handle.model.peft_config["default"].use_rslora  # every option of its adapter_config.json
    finally:
        grpo.release()
    assert not (tmp_path / "out").exists()


def test_an_adapter_for_another_model_is_refused_before_or_when_it_loads(tmp_path, tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowvram_grpo.settings.checks import before_load
    from lowvram_grpo.run.pipeline import GRPORun

    other = tmp_path / "wide-llama"  # another base, its name recorded in the adapter: refused before loading
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    adapter = _other_tools_adapter(tmp_path / "for-wide", tiny_model_dir, base=other)
    config = load_config("tiny", [f"lora.init_adapter={adapter}"])
    with pytest.raises(ConfigError, match=f"was trained on {other}, not on model.name builtin:tiny"):
        before_load(config)
    # no base recorded (an adapter made in memory): PEFT's shape check, once the model is loaded, in one line
    config_json = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config_json, "base_model_name_or_path": None}))
    grpo = GRPORun(load_config("tiny", [f"lora.init_adapter={adapter}"]), tmp_path / "out", backend="hf",
                   log=lambda *a: None)
    try:
        with pytest.raises(AdapterError, match=r"does not fit this base model .*size mismatch"):
            grpo.load()
    finally:
        grpo.release()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recorded, name, same", [
    ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "meta-llama/Llama-3.1-8B-Instruct", True),
    ("unsloth/llama-3.1-8b-instruct-unsloth-bnb-4bit", "meta-llama/Meta-Llama-3.1-8B-Instruct", True),
    ("Qwen/Qwen2.5-1.5B-Instruct", "unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit", True),
    ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct", False),
    ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct", False),
])
def test_one_base_model_by_its_usual_names(recorded, name, same):
    from lowvram_grpo.settings.checks import _base_identities

    assert bool(_base_identities(recorded) & _base_identities(name)) is same


def test_our_adapter_names_the_built_in_model_it_was_trained_on(tiny_run):
    from lowvram_grpo.settings.checks import _base_identities

    recorded = json.loads((tiny_run[0] / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert _base_identities(recorded) & _base_identities("builtin:tiny")
    assert not _base_identities(recorded) & _base_identities("builtin:smollm2")


def test_priming_is_skipped_from_an_adapter_unless_asked(tiny_run, tmp_path):
    adapter = tiny_run[0] / "adapter"
    assert load_config("smollm2_cpu").prime.steps > 0
    assert load_config("smollm2_cpu", [f"lora.init_adapter={adapter}"]).prime.steps == 0
    assert load_config("smollm2_cpu", [f"lora.init_adapter={adapter}", "prime.steps=5"]).prime.steps == 5
    preset = tmp_path / "mine.yaml"  # a preset that names both asks for both
    preset.write_text(f"model: {{name: builtin:tiny}}\nlora: {{init_adapter: {adapter}}}\nprime: {{steps: 3}}\n")
    assert load_config(str(preset)).prime.steps == 3


UNSLOTH_FROM_ADAPTER = """
import json, sys
from pathlib import Path
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.run.pipeline import GRPORun
adapter, out = Path(sys.argv[1]), Path(sys.argv[2])
config = load_config("tiny", [f"lora.init_adapter={adapter}", "train.max_steps=1", "eval.enabled=false"])
grpo = GRPORun(config, out, backend="unsloth", log=lambda *a: None)
handle = grpo.load()
from peft import get_peft_model_state_dict
from peft.utils import load_peft_weights
saved, live = load_peft_weights(str(adapter), device="cpu"), get_peft_model_state_dict(handle.model)
print(json.dumps({"backend": grpo.resolved.backend, "same_keys": saved.keys() == live.keys(),
                  "equal": all(bool((saved[k] == live[k].cpu()).all()) for k in saved),
                  "rslora": bool(handle.model.peft_config["default"].use_rslora),
                  "r": handle.model.peft_config["default"].r,
                  "trainable": handle.trainable_parameters(), "numel": sum(v.numel() for v in saved.values())}))
grpo.start(); grpo.prime(); grpo.train(); grpo.save(); grpo.finish()
"""


@pytest.mark.skipif(__import__("importlib").util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_the_unsloth_backend_trains_on_from_another_tools_adapter(tmp_path, tiny_model_dir):
    adapter = _other_tools_adapter(tmp_path / "theirs", tiny_model_dir)
    script = tmp_path / "from_adapter.py"
    script.write_text(UNSLOTH_FROM_ADAPTER)
    proc = subprocess.run([sys.executable, str(script), str(adapter), str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ENV, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert loaded == {"backend": "unsloth", "same_keys": True, "equal": True, "rslora": True, "r": 4,
                      "trainable": loaded["numel"], "numel": loaded["numel"]}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["backend"] == "unsloth" and summary["steps"] == 1
    start, trained = (load_file(str(d / "adapter_model.safetensors")) for d in (adapter, tmp_path / "out" / "adapter"))
    assert start.keys() == trained.keys() and any(not torch.equal(start[k], trained[k]) for k in start)
