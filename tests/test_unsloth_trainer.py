"""The trainer every GPU run uses, run for real: unsloth's RL-patched `UnslothGRPOTrainer` (GPU install set).

On a GPU, `PatchFastRL` replaces TRL's GRPOTrainer with the `UnslothGRPOTrainer` class unsloth generates from
the installed TRL's source (unsloth_compiled_cache/UnslothGRPOTrainer.py); our trainer is mixed over it
(training.trainer_class). In the GPU install set on a CPU, unsloth 2026.10.9 imports (its CPU fallback) and
its RL module, which needs triton, patches TRL the same way: these tests train tiny runs on the unsloth
backend through that class, as a user would run them (the CLI and the Python API in fresh processes), and
check what a GPU run relies on: the log names the class, GRPO steps and our callbacks run, checkpoints are
written, a kill -9 and `--resume` continue to the adapter of an unbroken run, save_lora / load_lora /
fast_generate work, the adapter loads in plain PEFT, and the report is written. What only a GPU runs
(CUDA kernels, vLLM) is listed in docs/gpu.md.

Runs in CI's GPU-set stage (LOWVRAM_GRPO_GPU_SET=1: fails there rather than skips if the set is not
installed); skips in the CPU set, whose unsloth cannot import its RL module (no triton).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def _pin(name: str) -> str:
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(name + "=="):
            return line.partition("==")[2]
    raise AssertionError(f"{name} is not pinned in requirements.txt")


def _installed(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _in_gpu_set() -> bool:
    return (all(_installed(n) == _pin(n) for n in ("unsloth", "unsloth_zoo", "vllm"))
            and _installed("triton") is not None)


if not _in_gpu_set():
    if os.environ.get("LOWVRAM_GRPO_GPU_SET") == "1":
        raise RuntimeError("LOWVRAM_GRPO_GPU_SET=1 but this venv is not requirements.txt's set: unsloth "
                           f"{_installed('unsloth')}, vllm {_installed('vllm')}, triton {_installed('triton')}")
    pytest.skip("not the GPU install set (requirements.txt): .ci/run runs this module in a venv of its own",
                allow_module_level=True)

RUN_ARGS = ["--preset", "tiny", "--backend", "unsloth", "--max-steps", "6", "--set", "train.save_steps=2"]
TRAINED_BY = "GRPO as the trainer runs it: trainer=UnslothGRPOTrainer "


def _env() -> dict:
    """As on a CI machine (CI set: GitHub Actions, this project's CI), whoever runs the tests: torch turns its
    custom-op alias check into an error there, which stopped every run here at its first step until
    unsloth_backend._pool_alias_check_warns."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CI": "true"}


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, in `cwd` (unsloth writes its unsloth_compiled_cache/ into the working dir)."""
    return subprocess.run([sys.executable, "-m", "lowvram_grpo.run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=_env())


def _tensors(adapter: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(adapter / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """An unbroken 6-step run, through the Python API, that then saves, loads and generates with the adapter."""
    root = tmp_path_factory.mktemp("unbroken")
    script = textwrap.dedent(f"""
        import json, sys
        from lowvram_grpo import train
        result = train("tiny", ["train.max_steps=6", "train.save_steps=2"], output_dir={str(root / 'run')!r},
                       backend="unsloth")
        handle = result.handle
        saved = handle.save_lora({str(root / 'saved')!r})
        request = handle.load_lora(saved)
        texts = handle.fast_generate([[{{"role": "user", "content": "What is 7 * 8?"}}]], lora_request=request)
        print("GENERATED", json.dumps([str(t) for t in texts]))
        print("SAVED", saved)
        from lowvram_grpo.core.internals import decode_graph_stats
        print("GRAPHS", json.dumps(decode_graph_stats(handle.model)))  # unsloth's counters, after its GRPO generate
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=900,
                          env=_env())
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return root, proc


def test_the_unsloth_backend_trains_through_unsloths_patched_trainer(unbroken):
    root, proc = unbroken
    log = proc.stdout
    assert TRAINED_BY in log, log[-3000:]
    assert "fp16 False -> True" not in log  # float32 asked, float32 trained (mark_requested_float32)
    run = root / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 6
    assert summary["grpo_settings"]["trainer"] == "UnslothGRPOTrainer"
    assert summary["before"] is not None and summary["after"] is not None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # our MetricsWriter callback, once per step
    assert all("reward" in r and "skipped_nonfinite" in r for r in rows)  # TRL's metrics + our guard's
    # completions.jsonl from unsloth's generated trainer's copy of TRL's rollout log (trl_compat.completion_log)
    written = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in written}) == [1, 2, 3, 4, 5, 6] and len(written) == 6 * 4
    assert all(r["truncated"] in (True, False) and isinstance(r["advantage"], float) and r["rewards"] for r in written)
    assert (run / "report.md").exists() and list(run.glob("*.png")) + list(run.glob("plots/*.png"))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]  # keep_checkpoints 2
    lora_b = [v for k, v in _tensors(run / "adapter").items() if "lora_B" in k]
    assert lora_b and any(bool(v.abs().sum() > 0) for v in lora_b), "GRPO moved nothing"
    # issue 54's decisions as this run has them: no vLLM sampler (no correction), no CUDA (no decode graphs); unsloth's
    # stats door answers from the real module (an empty state: its graphs are CUDA-only), and only a CUDA run's
    # summary carries it
    resolved = summary["resolved"]
    assert resolved["is_correction"] is False and resolved["decode_graphs"] is False
    assert resolved["decode_graphs_reason"] == "unsloth captures them on NVIDIA CUDA only"
    assert summary["grpo_settings"]["settings"]["vllm_importance_sampling_correction"] is False
    assert "decode_graph_stats" not in summary
    graphs = [line for line in log.splitlines() if line.startswith("GRAPHS ")]
    assert graphs and json.loads(graphs[-1][len("GRAPHS "):]) == {}


def test_unsloths_generate_is_scored_under_the_adapter_and_the_base(unbroken):
    """unsloth's patched generate returns no log-probs (the correction off): the rollouts' tokens are still scored under
    the adapter and under the base on unsloth's generated trainer (trl_compat.SampledTokenScores, both sides at
    generation: its loss scores its own way), under the name every path logs; judged from step 3, never flagged."""
    from lowvram_grpo.report.learning_signals import ADAPTER_SKIPPED_KEY, ADAPTER_VS_BASE_KEY, SAMPLER_BASE_GAP_KEY

    root, _ = unbroken
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0][ADAPTER_VS_BASE_KEY] == 0.0  # PEFT's B = 0 at step 1: the adapter is the base
    assert all(isinstance(r[ADAPTER_VS_BASE_KEY], float) and SAMPLER_BASE_GAP_KEY not in r for r in rows)
    assert [r.get(ADAPTER_SKIPPED_KEY) for r in rows] == [None, None, 0.0, 0.0, 0.0, 0.0]
    assert any(r[ADAPTER_VS_BASE_KEY] != 0.0 for r in rows[1:])  # the adapter moved: the two scores differ


def test_save_lora_load_lora_and_fast_generate_after_training(unbroken):
    root, proc = unbroken
    generated = json.loads(proc.stdout.split("GENERATED ", 1)[1].splitlines()[0])
    assert len(generated) == 1 and generated[0]
    saved, trained = _tensors(root / "saved"), _tensors(root / "run" / "adapter")
    assert saved.keys() == trained.keys()
    assert all(bool((saved[k] == trained[k]).all()) for k in saved)


def test_the_adapter_loads_in_plain_peft(unbroken):
    """No unsloth in this process: transformers + PEFT load the base and the adapter the unsloth run wrote."""
    root, _ = unbroken
    code = textwrap.dedent(f"""
        import json, sys, torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        config = json.load(open({str(root / 'run' / 'adapter' / 'adapter_config.json')!r}))
        base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
        model = PeftModel.from_pretrained(base, {str(root / 'run' / 'adapter')!r})
        assert "unsloth" not in sys.modules
        b = [p for n, p in model.named_parameters() if "lora_B" in n]
        print("LORA_B", len(b), float(sum(p.abs().sum() for p in b)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, total = proc.stdout.split("LORA_B ", 1)[1].split()
    assert int(count) > 0 and float(total) > 0


def test_kill_9_mid_run_then_resume_continues_to_the_unbroken_adapter(unbroken, tmp_path):
    root, _ = unbroken
    out = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lowvram_grpo.run", *RUN_ARGS, "--output-dir", str(out)],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, env=_env())
        try:
            deadline = time.time() + 600
            while not (out / "checkpoint-2").exists():  # renamed into place once complete
                assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before its first checkpoint"
                assert time.time() < deadline, "checkpoint-2 never appeared"
                time.sleep(0.1)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert not (out / "adapter").exists(), "the run finished before the kill: nothing was tested"

    resumed = _cli(tmp_path, "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from " in resumed.stdout and TRAINED_BY in resumed.stdout

    expected, got = _tensors(root / "run" / "adapter"), _tensors(out / "adapter")
    assert expected.keys() == got.keys()
    import torch

    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=0), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for row, ref in zip(rows, reference):
        assert row["reward"] == pytest.approx(ref["reward"], abs=1e-6), row["step"]


def test_a_bfloat16_model_on_a_cpu_trains_in_bf16_not_under_unsloths_fp16_autocast(tmp_path):
    """UnslothGRPOTrainer turns bf16=False, fp16=False into fp16 autocast on a device it deems without bf16 (a CPU),
    even for a bfloat16 model; resolve.for_unsloth_trainer asks for bf16 mixed precision there instead."""
    proc = _cli(tmp_path, "--preset", "tiny", "--backend", "unsloth", "--max-steps", "1",
                "--set", "model.dtype=bfloat16", "--set", "data.eval_size=1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("GRPO as the trainer runs it: "))
    assert line.startswith(TRAINED_BY) and " bf16=True fp16=False" in line, line
    assert "fp16 False -> True" not in line, line


def test_tools_run_multi_turn_through_unsloths_patched_trainer_with_results_masked(tmp_path):
    """Issue 32 on the unsloth backend: UnslothGRPOTrainer carries TRL's tool loop and tool_mask; a tiny GRPO step
    whose first turn is scripted to call three tools (tests/tool_transcripts.py), with GSPO's sequence-level ratio
    and the dr_grpo loss (issue 33's variants on this trainer): tool results out of the loss, failures answered."""
    from tool_transcripts import run_script

    script = run_script(tmp_path, "tiny", "unsloth",
                        ["train.importance_sampling_level=sequence", "train.loss_type=dr_grpo"])
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=_env())
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "TRAINER UnslothGRPOTrainer " in proc.stdout
    assert "importance_sampling_level=sequence" in proc.stdout and "loss_type=dr_grpo" in proc.stdout
    (turns,) = [line for line in proc.stdout.splitlines() if line.startswith("NEXT TURNS")]
    assert turns.startswith("NEXT TURNS [('transformers', 4, [")


IS_FLAG = """
import inspect, json, sys
from pathlib import Path
import dataclasses
from lowvram_grpo.model.backends import load_model, prepare_backend
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import IS_MODE, resolve
from lowvram_grpo.task.data import load_questions, to_prompt_rows

config = load_config("tiny", ["train.max_steps=1"])
resolved = resolve(config, detect(), "unsloth")
prepare_backend("unsloth")
# after unsloth's patch, as the pipeline imports it: unsloth's GRPOConfig
from lowvram_grpo.training.grpo import build_trainer
import trl
# unsloth's GRPOConfig (it keeps TRL's class name for pickling; its own fields tell): default correction off
assert "unsloth_num_chunks" in {f.name for f in dataclasses.fields(trl.GRPOConfig)}, trl.GRPOConfig
handle = load_model(resolved)
if sys.argv[1] == "on":  # what resolve decides where unsloth's vLLM engine samples (no vLLM engine on a CPU)
    handle.resolved = dataclasses.replace(handle.resolved, is_correction=True, is_mode=IS_MODE)
train, _ = load_questions(config.data)
trainer = build_trainer(handle, to_prompt_rows(train[:8], config.data.system_prompt), Path(sys.argv[2]))
import unsloth_zoo.rl_replacements as zoo
compute_loss = next(c.compute_loss for c in type(trainer).__mro__ if c.__name__ == "UnslothGRPOTrainer")
print("RESULT", json.dumps({
    "trainer": next(c.__name__ for c in type(trainer).__mro__ if c.__name__ == "UnslothGRPOTrainer"),
    "flag": trainer.vllm_importance_sampling_correction, "args_flag": trainer.args.vllm_importance_sampling_correction,
    "mode": trainer.args.vllm_importance_sampling_mode,
    "loss_passes_rollout_logps":
        "sampling_per_token_logps = sampling_per_token_logps," in inspect.getsource(compute_loss),
    "loss_logs_under_flag":
        'getattr(self, "vllm_importance_sampling_correction", False)' in inspect.getsource(compute_loss),
    "zoo_reads_trainer_flag": 'kwargs["vllm_importance_sampling_correction"] = getattr(trainer, '
                              '"vllm_importance_sampling_correction", False)'
                              in inspect.getsource(zoo.grpo_accumulated_loss),
}))
"""


@pytest.mark.parametrize("decided", ["on", "off"])
def test_the_decided_correction_reaches_the_attribute_unsloths_loss_reads(decided, tmp_path):
    """Our GRPOConfig on unsloth's real generated UnslothGRPOTrainer (built on a CPU with the tiny model): the decided
    flag is what the built trainer holds, unsloth's own default (False) does not replace an explicit True, and the code
    that reads it is this trainer's compute_loss (the rollout log-probs passed on, the sampling/* metrics logged under
    the flag) and unsloth_zoo's grpo_accumulated_loss (kwargs from the trainer's attribute, into grpo_compute_loss).
    "on" stands for unsloth's vLLM engine (resolve's decision there), which a CPU cannot start: the loss's ratio itself
    is read, not run (tests/test_gpu_wheels.py)."""
    proc = subprocess.run([sys.executable, "-c", IS_FLAG, decided, str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env=_env())
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(results[-1][len("RESULT "):])
    assert result["trainer"] == "UnslothGRPOTrainer"
    assert result["flag"] is result["args_flag"] is (decided == "on")
    assert result["mode"] == "sequence_mask"
    assert result["loss_passes_rollout_logps"] and result["loss_logs_under_flag"] and result["zoo_reads_trainer_flag"]
