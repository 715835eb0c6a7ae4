"""The first-run kit (bench/gpu_first_run.py) on a CPU at the tiny shape: the code a CUDA card runs, with the
CPU twin of torch.cuda's memory calls (HostMemory). It builds the stand-in checkpoint, measures a real
hf-nf4 run per phase, writes the JSON, then the capped run must end with the package's out-of-memory line
and a checkpoint, and `--resume` without the cap must finish it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

PHASES = {"load", "rollout", "training", "evaluation"}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit") / "gpu_first_run-tiny.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_first_run", "--preset", "tiny", "--variants", "hf-nf4",
                           "--steps", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_the_kit_measures_every_phase_beside_the_plan(kit):
    report, proc = kit
    assert report["ok"] and report["preset"] == "tiny" and report["machine"]["cuda"] is False
    assert report["model"]["shape"] == "builtin:tiny" and report["model"]["vocab"] == 512
    assert 200 < report["model"]["prompt_tokens_max"] <= 256  # padded up to train.max_prompt_length, as planned
    run = report["variants"]["hf-nf4"]
    assert run["backend"] == "hf" and run["resolved"]["load_in_4bit"] is True and run["resolved"]["generation"] == "transformers"
    assert set(run["phases"]) == PHASES
    assert run["phases"]["rollout"]["times"] == 2 and run["phases"]["evaluation"]["times"] == 1  # the trained adapter
    for name, phase in run["phases"].items():
        assert phase["peak_allocated"] > 0 and phase["used_peak"] >= phase["used_at_end"] > 0, name
    assert run["memory_source"]["allocated"].startswith("glibc malloc in use")  # the CPU twin says what it read
    assert len(run["steps"]) == 2 and all(s["rollout_s"] > 0 and s["training_s"] > 0 for s in run["steps"])
    assert run["step_adds_gib"] > 0 and run["step_held_gib"] > 0
    assert run["dtype"]["resolved"] == "float32" and "uint8" in run["dtype"]["parameter_gib_by_dtype"]  # NF4 codes
    assert run["optimizer"]["class"] == "bitsandbytes.optim.adamw.AdamW" and run["optimizer"]["optim_bits"] == 8
    assert run["optimizer"]["state_gib"] > 0
    assert {"weights", "lora", "optimizer", "activations", "logits", "cuda"} == set(run["plan"]["terms"])
    # every measured peak beside the plan (the arithmetic: tests/test_bench.py, on fixed numbers); above 1
    # exactly where the peak passed the plan's total
    assert set(run["peak_vs_plan"]) == set(run["peak_gib"]) == {"peak_allocated", "peak_reserved", "used_peak"}
    for key, share in run["peak_vs_plan"].items():
        assert share > 0 and (share == 1.0 or (share > 1) == (run["peak_gib"][key] > run["plan"]["total_gib"])), key
    assert run["checkpoint_bytes"] > 0 and run["checkpoint_bytes_doctor_estimate"] > 0
    assert "| hf-nf4 |" in proc.stdout  # the table printed at the end


def test_the_capped_run_ends_with_the_out_of_memory_line_and_resume_finishes_it(kit):
    report, proc = kit
    cap = report["cap"]
    assert cap["holds"] and cap["exit_code"] == 1 and cap["how"] == "HostMemory"
    assert cap["armed_after"] == "checkpoint-1" and cap["checkpoint_kept"] == "checkpoint-1"
    assert cap["held_gib"] < cap["cap_gib"] < cap["plan_total_gib"] and cap["cap_below_plan"]
    line = cap["error_line"]
    assert line.startswith("error: CUDA out of memory ") and line.endswith("start a new run with them lowered")
    assert "/run-capped/checkpoint-1" in line
    assert line in proc.stderr  # the package's own line, as the capped process printed it
    resume = report["resume"]
    assert resume["holds"] and resume["exit_code"] == 0 and resume["resumed_from"] == "checkpoint-1"
    assert resume["status"] == "complete" and resume["steps"] == 2


def test_the_stand_in_checkpoint_has_the_tables_shape_for_llama_and_qwen(tmp_path, monkeypatch):
    """build_checkpoint writes config.json through transformers' own config classes; memory.model_shape
    reads it back (as the plan reads any local checkpoint) and it equals the table's shape. Shards of at
    most SHARD_BYTES (small here, so there are several) load as one model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import gpu_first_run
    from bench.gpu_first_run import _same_shape, build_checkpoint
    from lowvram_grpo.memory import ModelShape, model_shape

    monkeypatch.setattr(gpu_first_run, "SHARD_BYTES", 100_000)

    for shape in (ModelShape("Llama-test", 64, 2, 4, 2, 128, 1000, False, 16),
                  ModelShape("Qwen2.5-test", 64, 2, 4, 2, 96, 1100, True)):
        folder = build_checkpoint(shape, tmp_path / shape.name, log=lambda *a: None)
        assert _same_shape(model_shape(str(folder)), shape)
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert sum(p.numel() for p in model.parameters()) == shape.params + (
            sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias")))  # Qwen2's q/k/v biases
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == shape.vocab
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 * 8?"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert 5 < len(ids) < 40 and max(ids) < 512  # text encodes with the tiny BPE; the fillers only decode
        assert tokenizer.decode([shape.vocab - 2]) == f"<{shape.vocab - 2}>"
