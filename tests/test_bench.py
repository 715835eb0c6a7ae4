"""The benchmark script runs end to end (on the tiny model, so it stays fast) and writes the JSON the
docs quote: `ours` and `trl` with `step_s` and `peak_rss_mb`, and the ratios between them. The ratio
helpers themselves are checked on fixed numbers (fast tier)."""
import json
import os
import subprocess
import sys

from conftest import REPO

import pytest  # noqa: E402


def _same_direction(ratio: float, value: float, reference: float) -> bool:
    """A ratio of value / reference is above 1 exactly when value is above reference (1.0: too close to tell
    at 3 decimals)."""
    return ratio == 1.0 or (ratio > 1) == (value > reference)


def test_ratios_divide_each_variant_by_the_reference_to_three_decimals():
    from bench.harness import ratios

    results = {"ours": {"step_s": 3.0, "peak_rss_mb": 500.0, "other": 1.0},
               "trl": {"step_s": 4.0, "peak_rss_mb": 1000.0, "other": 1.0},
               "unsloth": {"step_s": 2.0, "peak_rss_mb": 1500.0, "other": 1.0}}
    assert ratios(results, "trl", ("step_s", "peak_rss_mb")) == {
        "ours": {"step_s": 0.75, "peak_rss_mb": 0.5},
        "unsloth": {"step_s": 0.5, "peak_rss_mb": 1.5},
    }
    assert ratios({"a": {"step_s": 2.0}, "b": {"step_s": 3.0}}, "b", ("step_s",)) == {"a": {"step_s": 0.667}}


def test_the_host_memory_ratio_is_rounded_and_none_without_both_numbers():
    from bench.host_memory import _ratio

    assert _ratio(6.0, 4.0) == 1.5 and _ratio(1.0, 3.0) == 0.333 and _ratio(2.0, 3.0) == 0.667
    assert _ratio(None, 4.0) is None and _ratio(4.0, None) is None and _ratio(4.0, 0) is None


def test_peak_vs_plan_is_each_peak_as_a_share_of_the_plans_total():
    from bench.gpu_first_run import peak_vs_plan

    assert peak_vs_plan({"peak_allocated": 3.0, "peak_reserved": 4.5, "used_peak": 7.25}, 6.0) == {
        "peak_allocated": 0.5, "peak_reserved": 0.75, "used_peak": 1.208}


@pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"
def test_vs_trl_writes_step_times_memory_and_ratios(tmp_path, tiny_model_dir):
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vs_trl", "--preset", "tiny", "--steps", "2", "--generations", "2",
         "--tokens", "8", "--variants", "ours,ours_int8,ours_unmerged,ours_forward,trl", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for variant in ("ours", "trl"):
        result = report[variant]
        assert result["step_s"] > 0 and result["peak_rss_mb"] > 100
        assert len(result["all_steps_s"]) == 2
        assert set(result["parts_s"]) == {"generate", "rewards", "logps_nograd", "forward", "backward", "optimizer"}
        assert 0 < result["parts_s"]["optimizer"] < result["step_s"]
        assert result["parts_s"]["generate"] > 0 and result["parts_s"]["backward"] > 0
        assert result["parts_s"]["generate"] <= result["step_s"]  # a part is within its step, never counted twice
    assert report["trl"]["optim"].endswith("ADAMW_TORCH")
    assert set(report["ratios_vs_trl"]) == {"ours", "ours_int8", "ours_unmerged", "ours_forward"}  # all but the
                                                                                                   # reference
    # the correction runs on our loop (auto -> on), so TRL logs the sampler's gap; plain TRL samples with its own
    # forward
    for variant in ("ours", "ours_int8", "ours_unmerged", "ours_forward"):
        gap = report[variant]["sampler_gap"]
        assert 0 <= gap["mean_abs_logp_difference"] <= gap["max_abs_logp_difference"], variant
    assert report["ours_int8"]["sampler_gap"]["mean_abs_logp_difference"] > 0  # int8's rounding, not float32's
    assert report["trl"]["sampler_gap"] is None
    for key in ("step_s", "peak_rss_mb"):  # ours over TRL's, not the other way round
        ratio = report["ratios_vs_trl"]["ours"][key]
        assert ratio > 0 and _same_direction(ratio, report["ours"][key], report["trl"][key]), key
    assert "| ours |" in proc.stdout and "| trl |" in proc.stdout


@pytest.mark.slow
def test_vs_trl_takes_the_headline_against_the_fastest_plain_trl_and_keeps_each_rounds_order(tmp_path, tiny_model_dir):
    """TRL at its best: each plain-TRL variant's dtype, autocast and optimizer as named; the headline ratio against
    the fastest of them in the same run; two rounds in opposite orders, each round's figure and place kept (a
    variant asked --once: the first round only)."""
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vs_trl", "--preset", "tiny", "--steps", "2", "--generations", "2",
         "--tokens", "8",
         "--variants", "ours,trl_fp32,trl_8bit,trl_bf16", "--rounds", "2", "--once", "trl_bf16", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    plain = ("trl_fp32", "trl_8bit", "trl_bf16")
    fastest = min(plain, key=lambda name: report[name]["step_s"])
    assert report["fastest_plain_trl"] == fastest
    assert report["ratios_vs_fastest_plain_trl"]["ours"]["step_s"] == round(report["ours"]["step_s"]
                                                                            / report[fastest]["step_s"], 3)
    assert report["trl_fp32"]["weights_dtype"] == "float32" and not report["trl_fp32"]["bf16_autocast"]
    assert report["trl_8bit"]["optim"].endswith("PAGED_ADAMW_8BIT") and report["trl_bf16"]["bf16_autocast"]
    assert report["trl_bf16"]["weights_dtype"] == "float32"  # the tiny checkpoint's own dtype, as transformers loads it
    ours = report["ours"]["rounds"]
    assert [(r["round"], r["position"]) for r in ours] == [(1, 1), (2, 3)]  # first, then last of the reversed three
    assert ours[1]["order"] == "trl_8bit,trl_fp32,ours"
    assert report["ours"]["step_s"] == round(sum(r["step_s"] for r in ours) / 2, 3)  # the median of two
    assert "rounds" not in report["trl_bf16"] and report["trl_bf16"]["round"] == 1
    assert report["settings"]["first_round_only"] == ["trl_bf16"] and len(report["settings"]["loadavg_after"]) == 3


@pytest.mark.slow
def test_rss_timeline_names_the_phase_that_set_a_real_runs_peak(tmp_path, tiny_model_dir):
    """bench/rss_timeline.py on a real tiny run: the kernel's high-water mark at the end is the peak, each phase the
    run's output named has its highest RSS, the rises add up to the peak, and the run's summary is kept."""
    out, run = tmp_path / "rss.json", tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.rss_timeline", "--out", str(out), "--interval", "0.05", "--", "--preset", "tiny",
         "--max-steps", "3", "--set", "eval.enabled=false", "--output-dir", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    phases = record["phases"]
    assert record["returncode"] == 0 and record["peak_set_in"] in phases and "GRPO" in phases
    assert 0.1 < record["peak_gib"] < 8 and record["settings"]["cores"] >= 1
    assert max(p["max_rss_mib"] for p in phases.values()) <= record["peak_gib"] * 1024 + 1  # VmRSS never above VmHWM
    assert abs(sum(p["hwm_rise_mib"] for p in phases.values()) - record["peak_gib"] * 1024) < 2
    assert not any(name.startswith(("if ", "<")) for name in phases)  # warnings' source lines, a sample's tags
    assert record["summary"]["steps"] == 3 and f"set in phase {record['peak_set_in']!r}" in proc.stdout


def test_merge_reuse_times_both_calls_on_the_same_tokens(tmp_path, tiny_model_dir):
    """bench/merge_reuse.py on the tiny model with the fused layers and the adapter merged: both calls sample the same
    tokens, each has a time, and the ratio is reuse over merge."""
    out = tmp_path / "merge.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.merge_reuse", "--preset", "tiny", "--tokens", "3", "--repeats", "2", "--out",
         str(out), "--set", "decode.loop=lowvram", "--set", "decode.merge_lora=true", "--set", "decode.fused=true"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["same_tokens"] is True and "merged" in record["decode"] and "fused" in record["decode"]
    assert record["merge_ms"] > 0 and record["reuse_ms"] > 0 and len(record["all_ms"]["merge"]) == 2
    assert abs(record["reuse_vs_merge"] - record["reuse_ms"] / record["merge_ms"]) < 0.01


@pytest.mark.slow
def test_host_memory_bench_writes_peak_slope_and_step_times_per_variant(tmp_path, tiny_model_dir):
    from lowvram_grpo.core.allocator import mimalloc_library

    mimalloc = mimalloc_library() is not None
    out = tmp_path / "host_memory.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host_memory", "--prime-steps", "2", "--steps", "4", "--eval-size", "4",
         "--window", "3", "--variants", "off,head+trim" + (",head+trim+mimalloc,head+trim+mimalloc+unmerged" if mimalloc
                                                              else ""), "--out", str(out),
         "--", "--preset", "tiny"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    off, fixed = report["variants"]["off"], report["variants"]["head+trim"]
    for result in (off, fixed):
        assert result["peak_rss_mb"] > 100 and result["grpo_steps"] == 3  # the first step holds the trainer's setup
        assert result["rss_slope_mb_per_grpo_step_last"]["steps"] == 3
        assert result["grpo_step_s_median"] > 0 and result["prime_step_s_median"] > 0
    assert off["trimmed_boundaries"] == 0 and fixed["trimmed_boundaries"] >= 2 + 3  # priming + GRPO steps at least
    assert fixed["held_out"] == off["held_out"]  # same seed, same samples: the fixes change no result
    assert off["grpo_step_time_vs_off"] == off["peak_rss_vs_off"] == 1.0  # the reference against itself
    ratio = fixed["grpo_step_time_vs_off"]
    assert ratio > 0 and _same_direction(ratio, fixed["grpo_step_s_median"], off["grpo_step_s_median"])
    assert off["host_allocator_active"] == fixed["host_allocator_active"] == "glibc"
    if mimalloc:  # the package's CPU default: the same run on mimalloc, collected at the same boundaries
        on_mimalloc = report["variants"]["head+trim+mimalloc"]
        assert on_mimalloc["host_allocator_active"] == "mimalloc" and on_mimalloc["held_out"] == off["held_out"]
        assert on_mimalloc["trimmed_boundaries"] >= 2 + 3
        unmerged = report["variants"]["head+trim+mimalloc+unmerged"]  # a variant's own --set reaches its run
        assert unmerged["decode_merge_lora"] is False and on_mimalloc["decode_merge_lora"] is True


def test_docs_tools_table_is_what_bench_tools_table_prints_from_the_committed_seeds():
    """docs/results.md's tool-use table (issue 32) is `python -m bench.tools_table table`'s output, row for row, from
    bench/results/tools/seed-*.json: a seed added, a number edited by hand, or pooled rows left stale fail here."""
    from bench.tools_table import OUT, seed_records, table
    records = seed_records(REPO / OUT)
    assert records, "no committed seed of bench/results/tools"
    printed = table(records).splitlines()
    docs = (REPO / "docs" / "results.md").read_text().splitlines()
    start = docs.index(printed[0])
    assert docs[start:start + len(printed)] == printed
    assert not docs[start + len(printed)].startswith("|"), "docs/results.md's tools table has rows the JSON lacks"


def test_each_int8_candidate_computes_the_product_of_the_pinned_torch():
    """bench.int8_matmul's candidates run on the pinned torch and compute x @ W.T within int8's rounding."""
    import torch

    from bench.int8_matmul import candidates

    torch.manual_seed(0)
    weight = (torch.randn(96, 64) / 8).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    ref = x.float() @ weight.float().t()
    fns = candidates(weight)
    assert set(fns) == {"bf16", "int8_weight_only", "int8_dynamic_fbgemm", "int8_int_mm"}
    for name, fn in fns.items():
        out = fn(x).float()
        assert out.shape == (4, 96), name
        assert (out - ref).abs().mean() / ref.abs().mean() < 0.03, name


@pytest.mark.parametrize("rows", ["x", "4,", "0", "-4,16"])
def test_int8_matmul_refuses_bad_rows_in_one_line(tmp_path, rows):
    """`--rows` that is not positive whole numbers: one error line, exit 2, nothing measured or written."""
    out = tmp_path / "int8.json"
    proc = subprocess.run([sys.executable, "-m", "bench.int8_matmul", "--rows", rows, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: argument --rows: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_the_step_clock_counts_a_part_called_inside_itself_once():
    """TRL's vLLM branch of _generate_single_turn calls _generate_single_turn again (trl_compat.ModelSampler, the
    importance-sampling correction on): the inner call is inside the outer one's time."""
    import time

    from bench.vs_trl import StepClock

    class Trainer:
        def _generate_single_turn(self, depth):
            time.sleep(0.05)
            return self._generate_single_turn(depth - 1) if depth else None

    trainer, clock = Trainer(), StepClock()
    clock.wrap(trainer, "_generate_single_turn", lambda: "generate")
    clock.begin()
    trainer._generate_single_turn(1)
    clock.end()
    assert clock.steps[0]["generate"] <= clock.steps[0]["step"]


def test_default_job_search_record_of_a_folder_without_a_run_is_one_line(tmp_path):
    """`bench.default_job_search record --run DIR` where DIR holds no finished run: one error line, exit 2, no
    traceback, no record written (the records folder is relative to where it runs: tmp_path here)."""
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.default_job_search", "record", "--variant", "preset", "--seed", "1", "--run",
         str(empty), "--wall-seconds", "1", "--command", "x"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {empty} has no finished run"), proc.stderr
    assert not list(tmp_path.rglob("*.json"))
