"""What users of this stack expect beyond one training run: an installable package with a console script,
experiment trackers through TRL, and data-parallel GRPO with accelerate (2 CPU processes over gloo here)."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- trackers

def _tfrecords(path: Path):
    """The records of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    data, at = path.read_bytes(), 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        yield data[at + 12:at + 12 + length]
        at += 12 + length + 4


def test_report_to_tensorboard_writes_event_files_with_the_metrics(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--set", "train.report_to=tensorboard",
                   "--set", "eval.enabled=false", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list((out / "runs").glob("*/events.out.tfevents.*"))
    assert len(files) == 1, files
    scalars: dict[str, list[int]] = {}
    for record in _tfrecords(files[0]):
        event = Event.FromString(record)
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append(event.step)
    assert scalars["train/reward"] == [1, 2, 3] and "train/loss" in scalars
    assert _steps(out) == [1, 2, 3]  # metrics.jsonl is written either way


# --------------------------------------------------------------------------- several processes

@pytest.mark.slow
def test_accelerate_launch_two_processes_trains_once_and_writes_once(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (torchrun; gloo on a CPU): data-parallel GRPO on the
    hf backend. Each file is written once, by the main process; the adapter loads and differs from the start."""
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "lowvram_grpo.run", "--preset", "tiny",
         "--max-steps", "4", "--set", "train.save_steps=2", "--output-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 process(es) = 8 per generation" in proc.stdout  # both processes' groups make one generation batch
    assert proc.stdout.count("adapter: ") == 1 and proc.stdout.count("held-out metric") == 1  # one process speaks
    assert _steps(out) == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 4 and summary["resolved"]["num_processes"] == 2
    checkpoint = out / "checkpoint-4"
    assert ({"rng_state_0.pth", "rng_state_1.pth", "run_state.json", "optimizer.pt"}
            <= {p.name for p in checkpoint.iterdir()})
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())
    _generates_with(out / "adapter")


def _generates_with(adapter: Path) -> None:
    """The adapter loads with plain PEFT on its base and generates."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    ids = tokenizer("Ava has 3 apples.", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


# --------------------------------------------------------------------------- the installed package

@pytest.mark.slow
@pytest.mark.network  # pip fetches what /opt/wheels and the cache lack from the registry
def test_pip_install_gives_a_console_script_that_runs_from_any_folder(tmp_path):
    """In a fresh venv: the README's CPU torch, then `pip install -c requirements-cpu.txt .` (the pinned versions
    of what pyproject.toml declares), then `lowvram-grpo` from another folder: every preset listed and dry-run
    from the installed package data (presets/ of the repository), tiny trained."""
    import shutil

    source = tmp_path / "source"  # what a clone holds for building (pip builds in the tree it is given)
    for folder in ("lowvram_grpo", "presets"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for args in (["torch==2.13.0"], ["-c", str(REPO / "requirements-cpu.txt"), str(source)]):
        done = subprocess.run(pip + args, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = tmp_path / "somewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    listed = subprocess.run([str(venv / "bin" / "lowvram-grpo"), "--list-presets"], cwd=elsewhere, capture_output=True,
                            text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    names = sorted(p.stem for p in (REPO / "presets").glob("*.yaml"))
    assert [line.split()[0] for line in listed.stdout.splitlines()] == names
    for name in names:  # every preset, from the installed package data: its settings and memory plan
        dry = subprocess.run([str(venv / "bin" / "lowvram-grpo"), "--preset", name, "--dry-run"], cwd=elsewhere,
                             capture_output=True, text=True, timeout=300, env=env)
        assert dry.returncode == 0 and f"preset: {name}" in dry.stdout, (name, dry.stderr[-2000:])
    proc = subprocess.run([str(venv / "bin" / "lowvram-grpo"), "--preset", "tiny", "--max-steps", "2",
                           "--output-dir", "D"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((elsewhere / "D" / "summary.json").read_text())["steps"] == 2
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import lowvram_grpo; print(lowvram_grpo.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, env=env).stdout
    assert str(venv) in where  # the installed copy ran, not the checkout


def test_pyproject_installs_every_package_folder_and_the_top_level_presets():
    """pyproject.toml lists the packages by hand (the presets folder is mapped in from the top of the
    repository): a package folder missing from the list would be missing from `pip install .`."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "lowvram_grpo").rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders | {"lowvram_grpo.presets"}
    assert setuptools["package-dir"] == {"lowvram_grpo.presets": "presets"}
    assert (sorted(p.name for p in (REPO / "presets").glob("*.yaml"))
            and not (REPO / "lowvram_grpo" / "presets").exists())
