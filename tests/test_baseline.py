"""The prime-only baseline and the random-reward control (baseline.py) on a real tiny run: priming alone for the
run's training time; the run's GRPO again from the same start with random rewards."""
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
    # ... and started no step after that (before: the mean step stood in for the last one, which failed when two
    # steps took unequal times: CI, 2.3 s in 2 steps). The budget is read back from summary fields rounded to 0.1 s
    # and 0.01 s, so it is known to +-0.06 s (CI: a step started at 0.460 s of a budget read as 0.46)
    assert result["priming"]["last_step_started"] < budget + 0.06
    numbers = result["prime_only"]
    assert {"accuracy_strict", "accuracy_lenient", "accuracy_strict_ci", "accuracy_lenient_ci"} <= numbers.keys()
    assert numbers["n"] == run["after"]["n"]
    assert (primed_run / "prime_only" / "adapter" / "adapter_model.safetensors").is_file()
    assert f"prime-only {steps}" in proc.stdout and "accuracy_strict after (GRPO) - prime-only" in proc.stdout
    recorded = json.loads((primed_run / "summary.json").read_text())["controls"]["prime-only"]  # beside after
    assert recorded["numbers"]["accuracy_strict"] == numbers["accuracy_strict"]
    assert recorded["paired"]["accuracy_strict"]["n"] == run["after"]["n"]
    assert ("What GRPO added beyond priming alone for the same wall time: accuracy_strict"
            in (primed_run / "report.md").read_text())


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
    assert gained - lost == round((run["after"]["accuracy_strict"] - run["primed"]["accuracy_strict"])
                                  * run["after"]["n"])
    assert "| strict |" in proc.stdout and "(1 steps)" in proc.stdout


def test_the_docs_table_refuses_a_folder_without_a_finished_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.seeds_table", str(tmp_path), "--out", str(tmp_path / "s.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 2 and proc.stderr.startswith("error:") and "has no finished run" in proc.stderr
            and "Traceback" not in proc.stderr)


def test_random_reward_control_trains_the_run_again_with_random_rewards(primed_run):
    """`--control random-reward`: the run's GRPO from its start (the primed adapter) with its seed, steps, data and
    settings, every reward replaced by random draws; measured like the run; after vs the control in the run's
    summary.json (paired, McNemar) and report.md (one line)."""
    import yaml
    from safetensors.torch import load_file

    from lowvram_grpo.task.rewards import REWARD_MAX

    proc = _baseline(primed_run, "--control", "random-reward")
    assert proc.returncode == 0, proc.stderr[-3000:]
    control_dir = primed_run / "control_random_reward"
    assert (control_dir / "adapter" / "adapter_model.safetensors").is_file()
    run = json.loads((primed_run / "summary.json").read_text())
    control = json.loads((control_dir / "summary.json").read_text())
    assert control["status"] == "complete" and control["control"] == "random-reward"
    assert control["steps"] == run["steps"] == 2 and control["start"] == str(primed_run / "primed_adapter")

    config = yaml.safe_load((control_dir / "config.yaml").read_text())
    run_config = yaml.safe_load((primed_run / "config.yaml").read_text())
    assert config["lora"]["init_adapter"] == str(primed_run / "primed_adapter") and config["prime"]["steps"] == 0
    for section in ("model", "train", "data", "rewards", "eval"):
        assert config[section] == run_config[section], section
    start = load_file(str(primed_run / "primed_adapter" / "adapter_model.safetensors"))
    trained = load_file(str(control_dir / "adapter" / "adapter_model.safetensors"))
    assert start.keys() == trained.keys() and any(not (start[k] == trained[k]).all() for k in start)  # it trained

    rows = [json.loads(line) for line in (control_dir / "metrics.jsonl").read_text().splitlines()]
    run_rows = [json.loads(line) for line in (primed_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in run_rows] == [1, 2]
    for name in run_config["rewards"]["names"]:
        assert f"rewards/{name}/mean" not in rows[0], "the real reward must not be what the control trained on"
        for row in rows:
            mean, std = row[f"rewards/random_{name}/mean"], row[f"rewards/random_{name}/std"]
            assert 0 <= mean <= REWARD_MAX[name] and std > 0  # random draws on the reward's range, spread in every step
    assert all(row["frac_reward_zero_std"] == 0 for row in rows)  # every group has an advantage: pure noise
    assert [r["reward"] for r in rows] != [r["reward"] for r in run_rows]

    entry = run["controls"]["random-reward"]
    numbers, n = entry["numbers"], run["after"]["n"]
    assert numbers["n"] == n and len(numbers["strict_correct"]) == n and numbers == control["control_random_reward"]
    assert numbers["protocol"] == run["after"]["protocol"]
    for key in ("accuracy_strict", "accuracy_lenient"):
        paired = entry["paired"][key]
        assert paired["n"] == n and 0 <= paired["mcnemar_p"] <= 1
        assert paired["after_minus_control"] == pytest.approx(run["after"][key] - numbers[key])
        assert paired["newly_right"] - paired["newly_wrong"] == round(paired["after_minus_control"] * n)
    report = (primed_run / "report.md").read_text()
    [line] = [l for l in report.splitlines() if "What the reward added beyond the random-reward control:" in l]
    assert "accuracy_strict" in line and "McNemar p" in line and f"of {n} questions" in line
    assert "| held-out metric | random-reward control | after (GRPO) | after - control |" in report
    assert "What the reward added beyond the random-reward control:" in proc.stdout


def test_an_unknown_control_is_one_error_line(primed_run):
    before = sorted(p.name for p in primed_run.iterdir())
    proc = _baseline(primed_run, "--control", "random-rewards")
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    assert "--control: invalid choice: 'random-rewards' (choose from 'random-reward')" in proc.stderr
    assert sorted(p.name for p in primed_run.iterdir()) == before
