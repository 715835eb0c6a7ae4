"""The benchmark script runs end to end (on the tiny model, so it stays fast) and writes the JSON the
docs quote: `ours` and `trl` with `step_s` and `peak_rss_mb`, and the ratios between them."""
import json
import subprocess
import sys

from conftest import REPO


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
