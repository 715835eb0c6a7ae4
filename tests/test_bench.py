"""The benchmark script runs end to end (on the tiny model, so it stays fast) and writes the JSON the
docs quote: `ours` and `trl` with `step_s` and `peak_rss_mb`, and the ratios between them."""
import json
import subprocess
import sys

from conftest import REPO

import pytest  # noqa: E402

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def test_vs_trl_writes_step_times_memory_and_ratios(tmp_path, tiny_model_dir):
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vs_trl", "--preset", "tiny", "--steps", "2", "--generations", "2",
         "--tokens", "8", "--variants", "ours,trl", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for variant in ("ours", "trl"):
        result = report[variant]
        assert result["step_s"] > 0 and result["peak_rss_mb"] > 100
        assert len(result["all_steps_s"]) == 2
        assert set(result["parts_s"]) == {"generate", "rewards", "logps_nograd", "forward", "backward"}
        assert result["parts_s"]["generate"] > 0 and result["parts_s"]["backward"] > 0
    assert report["trl"]["optim"].endswith("ADAMW_TORCH")
    assert report["ratios_vs_trl"]["ours"]["step_s"] == round(report["ours"]["step_s"] / report["trl"]["step_s"], 3)
    assert "| ours |" in proc.stdout and "| trl |" in proc.stdout


def test_host_memory_bench_writes_peak_slope_and_step_times_per_variant(tmp_path, tiny_model_dir):
    from lowvram_grpo.allocator import mimalloc_library

    mimalloc = mimalloc_library() is not None
    out = tmp_path / "host_memory.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host_memory", "--prime-steps", "2", "--steps", "4", "--eval-size", "4",
         "--window", "3", "--variants", "off,head+trim" + (",head+trim+mimalloc" if mimalloc else ""), "--out", str(out),
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
    assert fixed["grpo_step_time_vs_off"] == round(fixed["grpo_step_s_median"] / off["grpo_step_s_median"], 3)
    assert off["host_allocator_active"] == fixed["host_allocator_active"] == "glibc"
    if mimalloc:  # the package's CPU default: the same run on mimalloc, collected at the same boundaries
        on_mimalloc = report["variants"]["head+trim+mimalloc"]
        assert on_mimalloc["host_allocator_active"] == "mimalloc" and on_mimalloc["held_out"] == off["held_out"]
        assert on_mimalloc["trimmed_boundaries"] >= 2 + 3
