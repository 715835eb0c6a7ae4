"""The first-run kit (bench/gpu_first_run.py) on a CPU at the tiny shape: the code a CUDA card runs, with the
CPU twin of torch.cuda's memory calls (HostMemory). It builds the stand-in checkpoint, measures a real
hf-nf4 run per phase, writes the JSON, then the capped run must end with the package's out-of-memory line
and a checkpoint, and `--resume` without the cap must finish it. Offline, every GPU preset's preparation
runs; a SIGTERM after the first variant leaves its figures in the JSON; the lent card's one command
(bench/gpu_window.sh) runs end to end in its CPU dry mode."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    assert [s["step"] for s in run["steps"]] == [1, 2]
    # the first step (compilation on CUDA) apart from the steady ones, rollout and training apart
    first, second = run["steps"]
    assert run["first_step_s"] == round(first["rollout_s"] + first["training_s"], 3)
    assert run["first_step_rollout_s"] == first["rollout_s"] and run["first_step_training_s"] == first["training_s"]
    assert run["steady_steps"] == 1 and run["steady_rollout_s_mean"] == second["rollout_s"]
    assert run["steady_step_s_mean"] == round(second["rollout_s"] + second["training_s"], 3)
    assert run["finished"] is True and run["wall_s"] > 0 and run["estimated_s"] > 0
    assert run["plan_lengths"]["train.max_completion_length"] == 24 and report["shortened"] == {}
    assert report["done"] == ["prepare", "hf-nf4", "cap", "resume"] and report["complete"] and "stopped" not in report
    assert report["budget"]["budget_s"] == 480 and report["elapsed_s"] < 480
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
    """build_checkpoint writes config.json through transformers' own config classes; model_shapes.model_shape
    reads it back (as the plan reads any local checkpoint) and it equals the table's shape. Shards of at
    most SHARD_BYTES (small here, so there are several) load as one model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import gpu_first_run
    from bench.gpu_first_run import _same_shape, build_checkpoint
    from lowvram_grpo.model_shapes import ModelShape, model_shape

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


def test_every_gpu_preset_prepares_offline(tmp_path):
    """The kit's preparation (the preset with the kit's data settings applied first, the shape, the sizing,
    the stand-in checkpoint and tokenizer, the padded prompt from the built-in problems, each variant's
    settings checked as the run checks them) with the hub and datasets offline, for every GPU preset. The
    checkpoint is built narrow (2 layers, 64 wide) at the shape's own vocabulary: what is read from it (the
    tokenizer, the prompt lengths) is the full model's, and nothing multi-GB is written."""
    presets = sorted(p.stem for p in (REPO / "presets").glob("*_4bit.yaml"))
    assert {"qwen1_5b_4bit", "llama8b_4bit"} <= set(presets)
    script = """
import dataclasses, json, sys, time
from pathlib import Path
from bench.gpu_first_run import build_checkpoint, build_parser, prepare

def narrow(shape, folder, log):
    small = dataclasses.replace(shape, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=None)
    return build_checkpoint(small, folder, log)

out = {}
for preset in sys.argv[2:]:
    args = build_parser().parse_args(["--preset", preset])
    args.started = time.monotonic()
    prep = prepare(args, Path(sys.argv[1]) / preset, log=lambda *a: None, build=narrow)
    out[preset] = {"shape": prep["shape"].name, "vocab": prep["shape"].vocab, "shortened": prep["shortened"],
                   "prompt_tokens": prep["prompt_tokens"], "work": prep["work"], "settings": prep["settings"],
                   "dataset": prep["config"].data.dataset}
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), *presets], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prepared = json.loads(proc.stdout.strip().splitlines()[-1])
    for preset, prep in prepared.items():
        assert prep["dataset"] is None, preset  # the kit's data settings, applied before any data is read
        assert prep["settings"], preset
        for variant, chosen in prep["settings"].items():
            assert "data.dataset=null" in chosen["overrides"] and chosen["train_questions"] > 0, (preset, variant)
            # a 1.5B+ shape cannot fit a budget on a CPU: the lengths are shortened, and the plan is made for the
            # shortened settings (those the child runs and measures), below the preset's own
            for key, change in prep["shortened"].items():
                if key != "--steps":
                    assert f"{key}={change['to']}" in chosen["overrides"], (preset, key)
            planned = chosen["plan_total_gib"]
            assert planned["kit_lengths"] < planned["preset_lengths"], (preset, variant, planned)
        assert prep["shortened"]["train.max_completion_length"]["to"] < prep["shortened"]["train.max_completion_length"]["from"]
        assert 0 < prep["prompt_tokens"] <= int(prep["shortened"].get("train.max_prompt_length", {"to": 10 ** 6})["to"])
    assert prepared["llama8b_4bit"]["vocab"] == 128256 and prepared["qwen1_5b_4bit"]["vocab"] == 151936


def test_the_budget_sizes_the_h100_work_and_skips_what_cannot_fit():
    """The sizing on the CUDA cost model (the H100's figures): the 1.5B shape's four pieces of work at the
    preset's 512 tokens do not fit 480 s, so the completions are shortened until all four fit; a budget too
    small for the most important piece fits none of them, at the shortest length."""
    from bench.gpu_first_run import FIT_SHARE, MIN_COMPLETION, CostModel, sizing

    work = [("variant", "unsloth"), ("variant", "hf"), ("cap", "hf"), ("resume", "hf")]
    costs = CostModel(True, 1.54e9)
    full = sum(costs.estimate(i, b, 3, 512, 16, 6) for i, b in work)
    assert full > 480 * FIT_SHARE
    size = sizing(work, costs, 480, 3, 512, 16, 6)
    assert size["fits"] == 4 and MIN_COMPLETION <= size["tokens"] < 512 and size["eval_batch"] == 6
    assert sum(size["estimates"]) <= 480 * FIT_SHARE
    assert sizing(work, costs, 60, 3, 512, 16, 6)["fits"] == 0
    costs.learn(100.0, 200.0)  # a child took twice its estimate: what is left is planned twice as long
    assert costs.estimate("variant", "hf", 3, 512, 16, 6) == 2 * CostModel(True, 1.54e9).estimate("variant", "hf", 3, 512, 16, 6)


def test_a_sigterm_after_the_first_variant_leaves_its_figures_in_the_json(tmp_path):
    """The kit rewrites its JSON after every phase and piece of work: stopped by SIGTERM once its first variant
    finished, it stops the running child, writes what finished with `"stopped": "SIGTERM"`, and exits 143."""
    out = tmp_path / "kit.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_first_run", "--preset", "tiny", "--variants", "hf-nf4",
                             "--steps", "2", "--budget-s", "600", "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and "hf-nf4" in json.loads(out.read_text())["done"]:  # written atomically: never half
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["stopped"] == "SIGTERM" and report["ok"] is False and "complete" not in report
    assert report["done"][:2] == ["prepare", "hf-nf4"]
    run = report["variants"]["hf-nf4"]
    assert run["finished"] and set(run["phases"]) == PHASES and len(run["steps"]) == 2
    assert run["peak_gib"]["peak_allocated"] > 0 and run["first_step_s"] > 0 and run["steady_step_s_mean"] > 0
    line = [s for s in stderr.splitlines() if s.startswith("error:")][-1]
    assert line.startswith(f"error: stopped by SIGTERM: {out} holds what finished (prepare, hf-nf4")


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_budget_is_one_error_line(value):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_first_run", "--preset", "tiny", "--budget-s", value],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--budget-s" in errors[0], proc.stderr


def test_the_doctor_says_which_import_it_probes_before_it_starts():
    """doctor's import probes (a fresh interpreter, the run's order) announce each import as it starts: on a
    GPU unsloth's import alone takes tens of seconds. After a failed import the rest go to a fresh interpreter,
    announced too; the default line goes to stderr and names the slow ones."""
    from lowvram_grpo.doctor import probe_imports

    started = []
    results = probe_imports(["json", "no_such_module_here", "csv"], progress=started.append)
    assert started == ["json", "no_such_module_here", "csv"]
    assert results["json"]["ok"] and not results["no_such_module_here"]["ok"] and results["csv"]["ok"]
    proc = subprocess.run([sys.executable, "-c", "from lowvram_grpo.doctor import probe_progress as p; p('unsloth'); p('json')"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "" and proc.stderr.splitlines() == [
        "doctor: importing unsloth (can take 30 s or more on a GPU: it patches transformers and trl) ...",
        "doctor: importing json ..."]


def test_the_window_script_parses():
    proc = subprocess.run(["bash", "-n", "bench/gpu_window.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_window_script_runs_end_to_end_in_its_dry_mode(tmp_path):
    """bench/gpu_window.sh's CPU dry mode: everything but the CUDA steps (no nvidia-smi; --preset tiny for both
    kits), at most 8 files in the folder, the kit's JSON valid whatever its budget let it finish."""
    out = tmp_path / "window"
    env = {**os.environ, "LOWVRAM_GPU_WINDOW_DRY": "1", "LOWVRAM_GPU_WINDOW_S": "60", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "bench/gpu_window.sh", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"nvidia-smi.txt", "versions.txt", "steps.txt", "kit1-tiny.json", "kit1-tiny.log"} <= set(files)
    assert "dry mode" in (out / "nvidia-smi.txt").read_text()
    versions = (out / "versions.txt").read_text()
    for name in ("python", "torch", "transformers", "trl", "bitsandbytes", "unsloth"):
        assert f"\n{name} " in "\n" + versions, name
    report = json.loads((out / "kit1-tiny.json").read_text())
    assert report["preset"] == "tiny" and report["budget"]["budget_s"] <= 60 and "prepare" in report["done"]
    assert report["budget"]["planned"][0] in ("variant unsloth", "variant hf-nf4")  # what matters most first
    assert report.get("complete") or report.get("stopped") == "budget" or report["skipped"]
    assert "=== done:" in (out / "steps.txt").read_text()


def test_the_window_script_refuses_bad_input(tmp_path):
    for argv, fragment in (([], "name the output folder"), ([str(tmp_path), "--fast"], "unknown option --fast"),
                           ([str(tmp_path / "a"), str(tmp_path / "b")], "one output folder")):
        proc = subprocess.run(["bash", "bench/gpu_window.sh", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and fragment in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
