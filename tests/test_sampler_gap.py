"""The sampler against the trainer (issue 51) on the generation paths a CPU runs: our decode loop and transformers'
generate, each a real tiny run. The sampler's per-token log-probs reach TRL 1.15's importance-sampling correction
(trl_compat.ModelSampler), which logs the gap (sampling/sampling_logp_difference/mean|max: abs(trainer - sampler)
log-prob of each sampled token) and the ratios it weights the loss by (sampling/importance_sampling_ratio/*).
vLLM's CPU engine: tests/test_vllm_engine.py (CI's vLLM stage)."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli

from lowvram_grpo.report.learning_signals import SAMPLER_GAP_KEY, SAMPLER_GAP_MAX_KEY, SAMPLER_GAP_THRESHOLD

pytestmark = pytest.mark.slow  # real runs (pytest.ini: the fast tier is -m "not slow")
RATIO_KEY = "sampling/importance_sampling_ratio/mean"


def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_our_loop_is_corrected_by_default_and_its_bf16_gap_is_logged_and_reported(tmp_path):
    """bfloat16 on a CPU: our loop samples from merged, fused, bf16-rounded weights with its own cache, the trainer
    scores with PEFT's unmerged forward; the gap is small but not 0, so the ratios TRL weights the loss by are not
    all 1. The default (train.is_correction=auto) turns the correction on for our loop, said in the log."""
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", "model.dtype=bfloat16", "--set",
                   "eval.enabled=false", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "IS correction on (sequence_mask): auto -> on: our decode loop samples" in log
    assert json.loads((out / "summary.json").read_text())["resolved"]["is_correction"] is True
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r[SAMPLER_GAP_KEY] <= r[SAMPLER_GAP_MAX_KEY] < SAMPLER_GAP_THRESHOLD, r
    assert any(r[SAMPLER_GAP_KEY] > 1e-6 for r in rows), rows  # bf16: the sampler is not exactly the trainer
    assert any(r[RATIO_KEY] != 1.0 for r in rows), rows  # ... and the loss is re-weighted
    report = (out / "report.md").read_text()
    assert ("## Sampler vs trainer (importance sampling)" in report
            and "![Sampler vs trainer](sampler_gap.png)" in report)
    assert f"above the threshold {SAMPLER_GAP_THRESHOLD}" in report and (out / "sampler_gap.png").is_file()


@pytest.mark.parametrize("extra", [("train.gradient_accumulation_steps=2", "train.per_device_train_batch_size=2"),
                                   ("train.loss_type=vespo",)],
                         ids=["sequence_mask-two-micro-batches", "token_truncate"])
def test_the_ratio_from_the_loss_is_the_one_of_trls_extra_forward_to_the_bit(tmp_path, extra):
    """train.is_logprobs=auto (trl_compat.RatioFromLoss) takes the correction's trainer log-probs from the loss's own
    forward instead of TRL's extra no-grad forward: the same run with train.is_logprobs=forward (TRL's) logs the same
    loss, gradient norm, rewards and gap bit for bit and the ratios' statistics to a float32 ulp, in both modes resolve
    gives (sequence_mask over two micro-batches of one generation: the metrics gathered over the whole batch;
    token_truncate, which vespo gets)."""
    rows = {}
    for source in ("auto", "forward"):
        out = tmp_path / source
        sets = [item for s in ("model.dtype=bfloat16", "eval.enabled=false", f"train.is_logprobs={source}", *extra)
                for item in ("--set", s)]
        proc = run_cli("--preset", "tiny", "--max-steps", "2", *sets, "--output-dir", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = "loss's own forward, no extra forward" if source == "auto" else "from an extra no-grad forward"
        assert said in proc.stdout + proc.stderr
        rows[source] = rows_of(out)
    timing = ("second", "time", "rss", "memory", "runtime", "per_second")
    compared = [{k: v for k, v in r.items() if not any(t in k.lower() for t in timing)} for r in rows["auto"]]
    assert [r["step"] for r in compared] == [1, 2]
    assert all(key in compared[0] for key in (SAMPLER_GAP_KEY, SAMPLER_GAP_MAX_KEY, RATIO_KEY, "loss", "grad_norm"))
    assert any(r[RATIO_KEY] != 1.0 for r in compared), compared  # bf16: a ratio that weighs
    forward = [{k: v for k, v in r.items() if not any(t in k.lower() for t in timing)} for r in rows["forward"]]
    # The ratio's statistics to a float32 ulp: on an AVX2-only EPYC (bf16 emulated) the ratio's mean differed by one
    # (1.0000275 vs 1.0000277) while the loss, the gradient norm and every other field were bit-equal
    ratio_stats = {k for r in compared for k in r if k.startswith("sampling/importance_sampling_ratio")}
    assert [{k: v for k, v in r.items() if k not in ratio_stats} for r in compared] == \
        [{k: v for k, v in r.items() if k not in ratio_stats} for r in forward]
    for ours, trls in zip(compared, forward):
        assert {k: ours[k] for k in ratio_stats} == pytest.approx({k: trls[k] for k in ratio_stats}, rel=1e-6, abs=0)


def test_the_ratio_from_the_loss_leaves_trls_extra_forward_out(tmp_path):
    """The forward it saves: per GRPO step, TRL's no-grad passes of the policy (its old log-probs and, beta > 0, the
    reference's with the adapter off) drop from two to one, and the loss still carries the ratio."""
    import torch

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    no_grad_passes = {}
    for source in ("auto", "forward"):
        config = load_config("tiny", ["train.max_steps=2", "eval.enabled=false", "model.dtype=bfloat16",
                                      f"train.is_logprobs={source}"])
        assert config.train.beta > 0
        handle = load_model(resolve(config, detect(), "hf"))
        train_q, _ = load_questions(config.data)
        trainer = build_trainer(handle, to_prompt_rows(train_q, config.data.system_prompt), tmp_path / source)
        own = trainer._get_per_token_logps_and_entropies
        calls = []

        def counted(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return own(*args, **kwargs)

        trainer._get_per_token_logps_and_entropies = counted
        trainer.train()
        no_grad_passes[source] = calls.count(False)
        assert calls.count(True) == 2  # the loss's forward, one a step
        assert trainer.ratio_batches_from_loss == (2 if source == "auto" else 0)
    assert no_grad_passes == {"auto": 2, "forward": 4}


def test_transformers_generate_logs_the_gap_when_the_correction_is_asked_for(tmp_path):
    """decode.loop=transformers with train.is_correction=on: transformers' processed scores give the sampled
    tokens' log-probs; in float32 with the trainer's own forward they agree with the trainer's to rounding. With
    auto the correction stays off there: no sampling/* column."""
    out = tmp_path / "on"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", "decode.loop=transformers", "--set",
                   "train.is_correction=on", "--set", "eval.enabled=false", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("IS correction on (sequence_mask): train.is_correction=on: transformers' generate samples"
            in proc.stdout + proc.stderr)
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r[SAMPLER_GAP_MAX_KEY] < 1e-3 and abs(r[RATIO_KEY] - 1) < 1e-3, r
    off = tmp_path / "auto"
    proc = run_cli("--preset", "tiny", "--max-steps", "1", "--set", "decode.loop=transformers", "--set",
                   "eval.enabled=false", "--output-dir", str(off))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(key.startswith("sampling/importance") for r in rows_of(off) for key in r)  # no correction; the
    assert all("sampling/adapter_minus_base_logp/mean" in r for r in rows_of(off))  # adapter vs base: every path
    assert "Not measured: the importance-sampling correction was off" in (off / "report.md").read_text()


def test_a_sampler_off_the_trainers_policy_shows_a_large_gap_on_the_progress_line(tmp_path, capsys):
    """Planted: the sampler draws at temperature 0.1 while the trainer scores at the run's temperature (TRL's
    generation config, which our loop reads, set apart from the trainer's). The gap is far above the threshold and
    the progress line says so."""
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.training.grpo import build_trainer

    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false"])
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, _ = load_questions(config.data)
    trainer = build_trainer(handle, to_prompt_rows(train_q, config.data.system_prompt), tmp_path)
    trainer.generation_config.temperature = 0.1
    trainer.train()
    assert handle.model._lowvram_decode_calls > 0  # the rollouts came from our loop
    rows = rows_of(tmp_path)
    assert rows[0][SAMPLER_GAP_KEY] > SAMPLER_GAP_THRESHOLD, rows[0]
    assert f"nats/token > {SAMPLER_GAP_THRESHOLD}" in capsys.readouterr().err
