"""The prime-only baseline (baseline.py) on a real tiny run: priming alone for the run's training time."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"


def _baseline(*args):
    return subprocess.run([sys.executable, "-m", "lowvram_grpo.baseline", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def primed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", "prime.steps=2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_prime_only_for_the_runs_training_time(primed_run):
    proc = _baseline(primed_run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((primed_run / "summary.json").read_text())
    result = json.loads((primed_run / "prime_only" / "summary.json").read_text())
    budget = run["priming"]["seconds"] + run["train_seconds"]
    assert result["budget_seconds"] == pytest.approx(budget, abs=0.1)
    steps, seconds = result["priming"]["steps"], result["priming"]["seconds"]
    assert steps >= 1 and len(result["priming"]["losses"]) == steps
    assert seconds >= budget - 0.1  # it primed until the budget was spent ...
    assert seconds - seconds / steps <= budget + 0.1  # ... and started no step after that
    numbers = result["prime_only"]
    assert {"accuracy_strict", "accuracy_lenient", "accuracy_strict_ci", "accuracy_lenient_ci"} <= numbers.keys()
    assert numbers["n"] == run["after"]["n"]
    assert (primed_run / "prime_only" / "adapter" / "adapter_model.safetensors").is_file()
    assert f"prime-only {steps}" in proc.stdout and "accuracy_strict after (GRPO) - prime-only" in proc.stdout


def test_prime_only_for_a_fixed_number_of_steps(primed_run):
    proc = _baseline(primed_run, "--steps", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((primed_run / "prime_only" / "summary.json").read_text())["priming"]["steps"] == 3


def test_a_dir_that_is_not_a_finished_run_is_one_error_line(tmp_path):
    proc = _baseline(tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    assert "no config.yaml and summary.json" in proc.stderr


def test_the_docs_table_reads_the_run_and_its_baseline(primed_run, tmp_path):
    """bench/seeds_table.py, which writes docs/results.md's default-job table, reads the run and its
    prime-only column through RunDir and prints the paired change GRPO made."""
    assert _baseline(primed_run, "--steps", 1).returncode == 0
    out = tmp_path / "seeds.json"
    proc = subprocess.run([sys.executable, "-m", "bench.seeds_table", str(primed_run), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((primed_run / "summary.json").read_text())
    [row] = json.loads(out.read_text())["runs"]
    assert row["after"]["accuracy_strict"] == run["after"]["accuracy_strict"] and row["prime_only"]["steps"] == 1
    gained, lost, _ = row["paired_accuracy_strict"]
    assert gained - lost == round((run["after"]["accuracy_strict"] - run["primed"]["accuracy_strict"]) * run["after"]["n"])
    assert "| strict |" in proc.stdout and "(1 steps)" in proc.stdout


def test_the_docs_table_refuses_a_folder_without_a_finished_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.seeds_table", str(tmp_path), "--out", str(tmp_path / "s.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "has no finished run" in proc.stderr and "Traceback" not in proc.stderr
