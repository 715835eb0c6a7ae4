"""Issue 53, watching a run learn, on real tiny runs: completions.jsonl (completions.py) has a row per completion of
every written step with every field, stays under its cap on a 200-step run and still covers it; a run whose reward is
always 0 shows what the model wrote in the report; the held-out curve (eval.every_steps, validation.py) goes into
metrics.jsonl from its step 0 (curve_start.json: the adapter GRPO starts from, measured before GRPO), keeps
best_adapter/ at the argmax of the curve (named in summary.json, measured on the held-out questions), and a run stopped
between two measurements, or during one (step 0's too), and resumed ends with the curve whole and equal to an unbroken
run's."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.report.run_dir import RunDir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FIELDS = {"step", "group", "prompt_id", "prompt", "answer", "completion", "rewards", "reward", "advantage", "truncated",
          "tool_calls"}
TINY = ["--preset", "tiny"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_prompts_once(rows):
    """Each prompt in full on its id's first row in the file, null on the others."""
    seen = set()
    for row in rows:
        assert (row["prompt"] is not None) == (row["prompt_id"] not in seen), row
        seen.add(row["prompt_id"])


def test_every_logged_step_has_its_completions_with_every_field(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "3", "--set", "eval.enabled=false", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out / "completions.jsonl")
    logged = [r["step"] for r in _rows(out / "metrics.jsonl")]
    assert logged == [1, 2, 3]
    config = RunDir(out).read_config()
    for step in logged:  # tiny: one prompt of 4 completions a step, so its only group
        of_step = [r for r in rows if r["step"] == step]
        assert len(of_step) == config.train.num_generations and {r["group"] for r in of_step} == {0}
    for row in rows:
        assert set(row) == FIELDS, set(row) ^ FIELDS
        assert set(row["rewards"]) == set(config.rewards.names)
        assert isinstance(row["completion"], str) and isinstance(row["advantage"], float)
        assert row["truncated"] in (True, False) and row["tool_calls"] == [] and row["answer"] is not None
        weights = dict(zip(config.rewards.names, config.rewards.weight_list))
        assert row["reward"] == pytest.approx(sum(weights[k] * v for k, v in row["rewards"].items()))
    _check_prompts_once(rows)
    # the advantages are the ones TRL trained with: group-normalised, so they sum to ~0 over each group
    for step in logged:
        assert abs(sum(r["advantage"] for r in rows if r["step"] == step)) < 1e-3
    # truncation as TRL counts it: the step's clipped_ratio is the share of its completions marked cut
    for metrics_row in _rows(out / "metrics.jsonl"):
        marked = [r["truncated"] for r in rows if r["step"] == metrics_row["step"]]
        assert metrics_row["completions/clipped_ratio"] == pytest.approx(sum(marked) / len(marked))


def test_a_200_step_run_stays_under_the_cap_and_covers_the_run(tmp_path):
    out = tmp_path / "run"
    cap_mb = 0.02
    proc = run_cli(*TINY, "--max-steps", "200", "--set", "eval.enabled=false", "--set", "train.max_completion_length=4",
                   "--set", "train.num_generations=2", "--set", f"log.completions_max_mb={cap_mb}",
                   "--set", "train.save_steps=1000", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = out / "completions.jsonl"
    assert path.stat().st_size <= cap_mb * 1_000_000
    rows = _rows(path)
    steps = sorted({r["step"] for r in rows})
    assert steps[-1] == 200 and steps[0] <= 64 and len(steps) >= 8, steps  # thinned, not cut: the whole run, thinly
    every = min(b - a for a, b in zip(steps, steps[1:-1]))  # the policy's step after its doublings (the last is extra)
    assert every & (every - 1) == 0 and every > 1 and all(s % every == 0 for s in steps[:-1]), steps
    for row in rows:
        assert set(row) == FIELDS
    _check_prompts_once(rows)
    assert sum(1 for r in _rows(out / "metrics.jsonl")) == 200


REWARD_ZERO = """
def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)
"""


def test_a_run_whose_reward_is_always_0_shows_its_completions_in_the_report(tmp_path):
    (tmp_path / "zero.py").write_text(REWARD_ZERO)
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "3", "--set", "eval.enabled=false",
                   "--set", f"rewards.module={tmp_path / 'zero.py'}",
                   "--set", "rewards.names=[zero]", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out / "completions.jsonl")
    assert rows and all(r["reward"] == 0.0 and r["rewards"] == {"zero": 0.0} for r in rows)
    report = (out / "report.md").read_text()
    section = report[report.index("## Completions during GRPO"):]
    assert "### Step 3 (latest; mean reward 0.000" in section
    from lowvram_grpo.report.build import _printable

    latest = [r for r in rows if r["step"] == 3]
    for row in latest[:3]:  # what the model wrote, with its score
        assert _printable(row["completion"]).strip() in section
    # every step's mean is 0: the worst is the earliest, shown after the latest, 3 completions each
    assert "### Step 1 (worst reward; mean reward 0.000" in section
    assert section.count("reward 0.000 (zero 0.000)") == 6
    assert "Ben" in section or "has" in section  # the question the completions answer


def _curve(rows):
    return [(r["step"], r["validation/reward_mean"]) for r in rows if "validation/reward_mean" in r]


def _start(out):
    """The curve's step 0 as the run recorded it (curve_start.json), or None."""
    return RunDir(out).read_curve_start()


def _whole_curve(out):
    """[(step, value)] from step 0 (curve_start.json) through metrics.jsonl's points."""
    start = _start(out)
    return ([(0, start["validation/reward_mean"])] if start else []) + _curve(_rows(out / "metrics.jsonl"))


# A reward that is a fixed function of the completion's characters: the validation reward_mean moves up and down
# as the adapter changes what the model writes (the curve of the seed below peaks at step 4 of 6, not at the end).
HASHY = """
def hashy(prompts, completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) % 11) / 10 for t in texts]
"""


@pytest.fixture(scope="module")
def no_gold(tmp_path_factory):
    """Questions without gold answers (a CSV with a question column only) and the reward above: the curve's criterion
    is the validation reward_mean, which moves from point to point (tiny's accuracy is 0 everywhere)."""
    folder = tmp_path_factory.mktemp("data")
    lines = ["question"] + [f"Write about item {i} and the number {i * 7}." for i in range(80)]
    (folder / "q.csv").write_text("\n".join(lines) + "\n")
    (folder / "hashy.py").write_text(HASHY)
    return ["--set", f"data.dataset={folder / 'q.csv'}", "--set", f"rewards.module={folder / 'hashy.py'}",
            "--set", "rewards.names=[hashy]", "--set", "eval.every_steps=2", "--set", "eval.validation_size=8",
            "--set", "train.save_steps=1", "--set", "train.keep_checkpoints=6"]


@pytest.fixture(scope="module")
def unbroken(no_gold, tmp_path_factory):
    out = tmp_path_factory.mktemp("unbroken") / "run"
    proc = run_cli(*TINY, "--max-steps", "6", *no_gold, "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_curve_goes_into_metrics_and_best_adapter_is_its_argmax(unbroken):
    rows = _rows(unbroken / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))  # one row a GRPO step: step 0 is not a row
    curve = _whole_curve(unbroken)
    assert [s for s, _ in curve] == [0, 2, 4, 6] and len({v for _, v in curve}) > 1, curve
    assert _start(unbroken)["validation/n"] == 8 and _start(unbroken)["start"] == "base"  # no priming: the base
    assert all(r["validation/n"] == 8 for r in rows if "validation/n" in r)
    best_step = max(curve, key=lambda p: (p[1], -p[0]))[0]
    assert best_step not in (0, 6), curve  # the case the best adapter is for: the run's end is not its best point
    summary = json.loads((unbroken / "summary.json").read_text())
    assert summary["best_adapter"]["step"] == best_step
    assert summary["best_adapter"]["dir"] == str(unbroken / "best_adapter")
    assert json.loads((unbroken / "best_adapter" / "best_step.json").read_text())["step"] == best_step
    assert summary["best_adapter"]["same_as_after"] is False
    assert summary["best"]["n"] == summary["after"]["n"]  # measured on the held-out questions too, paired
    assert set(summary["paired_changes_best"]) <= {"before_to_best", "after_to_best"}  # no gold answers: reward only
    # the best adapter is the weights of its step: its checkpoint's adapter, bit for bit
    from safetensors.torch import load_file

    best = load_file(str(unbroken / "best_adapter" / "adapter_model.safetensors"))
    at_step = load_file(str(unbroken / f"checkpoint-{best_step}" / "adapter_model.safetensors"))
    assert best.keys() == at_step.keys() and all((best[k] == at_step[k]).all() for k in best)
    # the validation questions are none of the held-out ones and are not trained on
    report = (unbroken / "report.md").read_text()
    assert "## Held-out curve during GRPO" in report and f"Best: step {best_step}" in report
    assert f"step 0: {curve[0][1]:.3f}, step 2: " in report
    assert (unbroken / "validation.png").is_file()


# Pauses the CALL-th call of evaluation.generate_answers for a few seconds after touching MARKER (the signal lands in
# that measurement); SLOW_FROM: from this GRPO step on, each step's end touches MARKER (a stop between measurements).
DRIVER = """
import os, sys, time
from pathlib import Path
from lowvram_grpo.evaluate import evaluation
original, calls = evaluation.generate_answers, [0]
def paused(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ.get("PAUSE_CALL", "0")):
        Path(os.environ["MARKER"]).touch()
        time.sleep(3)
    return original(*args, **kwargs)
evaluation.generate_answers = paused
from transformers import TrainerCallback
from lowvram_grpo.training import grpo as training
build = training.build_trainer
class Mark(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ.get("MARK_AT", "0")):
            Path(os.environ["MARKER"]).touch()
            time.sleep(3)
def marked(*a, **k):
    trainer = build(*a, **k)
    trainer.callback_handler.callbacks.insert(0, Mark())  # before StopOnSignal: the stop comes at this step's end
    return trainer
training.build_trainer = marked
from lowvram_grpo.run.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _stopped_then_resumed(tmp_path, no_gold, env):
    script, out, marker = tmp_path / "driver.py", tmp_path / "run", tmp_path / "marker"
    script.write_text(DRIVER)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), *TINY, "--max-steps", "6", *no_gold,
                                 "--output-dir", str(out)],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **ENV, "MARKER": str(marker), **env},
                                preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                    for s in (signal.SIGTERM, signal.SIGINT)])
        try:
            deadline = time.time() + 300
            while not marker.exists():
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 143, stderr[-3000:]
    stopped_rows = _rows(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []  # none: stopped pre-GRPO
    stopped_start = _start(out)
    resumed = run_cli("--resume", str(out), env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, (stopped_rows, stopped_start, stderr), resumed


def _same_curve_and_best(out, unbroken):
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    got, want = _whole_curve(out), _whole_curve(unbroken)
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 2, 4, 6]  # whole, from step 0: each point once
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6)  # and the unbroken run's
    summary, ref = (json.loads((d / "summary.json").read_text()) for d in (out, unbroken))
    assert summary["best_adapter"]["step"] == ref["best_adapter"]["step"] == RunDir(out).best_facts()["step"]
    completions = _rows(out / "completions.jsonl")
    assert sorted({r["step"] for r in completions}) == list(range(1, 7))  # the steps after the checkpoint written once
    assert len(completions) == 6 * RunDir(out).read_config().train.num_generations
    _check_prompts_once(completions)


def test_a_stop_between_two_measurements_and_resume_keep_the_curve_whole(tmp_path, no_gold, unbroken):
    out, (stopped_rows, stopped_start, _), resumed = _stopped_then_resumed(tmp_path, no_gold, {"MARK_AT": "3"})
    assert [s for s, _ in _curve(stopped_rows)] == [2]  # stopped after step 3: between the points of steps 2 and 4
    assert stopped_start is not None and _start(out) == stopped_start  # step 0 kept as it was: not measured again
    assert "held-out curve: step 0" not in resumed.stdout
    _same_curve_and_best(out, unbroken)


def test_a_stop_during_a_measurement_is_measured_on_resume(tmp_path, no_gold, unbroken):
    # generate_answers' calls: 1 the held-out 'before', 2 step 0's point, 3 step 2's, 4 step 4's: the signal lands in it
    out, (stopped_rows, stopped_start, _), resumed = _stopped_then_resumed(tmp_path, no_gold, {"PAUSE_CALL": "4"})
    assert [r["step"] for r in stopped_rows][-1] == 4 and [s for s, _ in _curve(stopped_rows)] == [2]
    assert stopped_start is not None and _start(out) == stopped_start
    assert "held-out curve: step 4's point measured on resume" in resumed.stdout
    _same_curve_and_best(out, unbroken)


def test_a_stop_during_step_0_stops_before_grpo_and_resume_measures_it(tmp_path, no_gold, unbroken):
    # generate_answers' calls: 1 the held-out 'before', 2 step 0's point (the adapter GRPO starts from): the signal
    # lands in it, and the run stops there, before GRPO's first step (no GRPO checkpoint: --resume starts it again)
    out, (stopped_rows, stopped_start, stderr), resumed = _stopped_then_resumed(tmp_path, no_gold, {"PAUSE_CALL": "2"})
    assert stopped_rows == [] and stopped_start is None
    assert "while measuring the held-out curve's step 0" in stderr and "no checkpoint yet" in stderr
    assert "running it again from the start" in resumed.stdout
    assert "held-out curve: step 0 (the base model" in resumed.stdout
    _same_curve_and_best(out, unbroken)


def test_the_curve_changes_nothing_that_is_trained(tmp_path):
    """Built-in problems: the validation questions are generated after the training ones, and measuring saves, loads
    and answers greedily without touching the trained adapter or the random streams: a run with the curve trains the
    very adapter a run without it trains."""
    runs = {}
    for every in (0, 2):
        out = tmp_path / f"every{every}"
        proc = run_cli(*TINY, "--max-steps", "4", "--set", f"eval.every_steps={every}",
                       "--set", "eval.validation_size=4", "--output-dir", str(out), env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[every] = out
    from safetensors.torch import load_file

    without, with_curve = (load_file(str(runs[e] / "adapter" / "adapter_model.safetensors")) for e in (0, 2))
    assert without.keys() == with_curve.keys() and all((without[k] == with_curve[k]).all() for k in without)
    rows = {e: _rows(runs[e] / "metrics.jsonl") for e in runs}
    assert [r["reward"] for r in rows[0]] == [r["reward"] for r in rows[2]]
    assert [r["step"] for r in rows[2] if "validation/accuracy_strict" in r] == [2, 4]
    assert not (runs[0] / "best_adapter").exists() and (runs[2] / "best_adapter").is_dir()
    # the same held-out questions, answered the same by the same adapter
    summaries = [json.loads((runs[e] / "summary.json").read_text()) for e in (0, 2)]
    assert summaries[0]["after"]["strict_correct"] == summaries[1]["after"]["strict_correct"]
    assert summaries[0]["samples"] == summaries[1]["samples"]


def test_a_checkpoint_keeps_the_best_adapter_of_its_step_and_a_resume_puts_it_back(tmp_path):
    """RunDir: checkpoint-N holds best_adapter/ as it was at step N, one folder down (transformers' resume loads every
    sub-folder that holds adapter weights as an adapter); restore_best puts it back over a newer best, and removes a
    best when the checkpoint had none."""
    run = RunDir(tmp_path / "run").create()

    def adapter(step):
        folder = run.validation_staging() / "adapter"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_text(f"weights of step {step}")
        return folder

    def trainer_files(root, step):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / "adapter_model.safetensors").write_text(f"step {step}")

    run.save_checkpoint(1, lambda root: trainer_files(root, 1), {"global_step": 1}, keep=5)
    run.keep_best(adapter(2), {"step": 2, "criterion": "validation/reward_mean", "value": 0.5})
    checkpoint = run.save_checkpoint(3, lambda root: trainer_files(root, 3), {"global_step": 3}, keep=5)
    saved = checkpoint / "validation" / "best_adapter"
    assert (saved / "adapter_model.safetensors").read_text() == "weights of step 2"
    assert not any((d / "adapter_model.safetensors").exists() for d in checkpoint.iterdir() if d.is_dir())
    run.keep_best(adapter(4), {"step": 4, "criterion": "validation/reward_mean", "value": 0.7})  # after the checkpoint
    assert run.best_facts()["step"] == 4
    run.restore_best(checkpoint)
    assert run.best_facts()["step"] == 2
    assert (run.best_adapter_dir / "adapter_model.safetensors").read_text() == "weights of step 2"
    run.restore_best(tmp_path / "run" / "checkpoint-1")  # no best yet at step 1
    assert not run.best_adapter_dir.exists() and run.best_facts() is None


@pytest.mark.parametrize("trackers, on", [("wandb", True), ("trackio,tensorboard", True), ("tensorboard", False),
                                          ("none", False)])
def test_trls_completions_table_is_on_for_the_trackers_that_show_it(trackers, on):
    """TRL 1.15's log_completions sends its completions table to W&B and trackio (GRPOTrainer.log): on with either,
    never printed (completions.jsonl and the report have them); GRPOConfig accepts what is asked."""
    from trl import GRPOConfig

    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.training.grpo import grpo_config_kwargs

    kwargs = grpo_config_kwargs(resolve(load_config("tiny", [f"train.report_to={trackers}"]), detect()), "/tmp/unused")
    assert kwargs["log_completions"] is on and kwargs["num_completions_to_print"] == 0
    assert GRPOConfig(**kwargs).log_completions is on
    off = load_config("tiny", [f"train.report_to={trackers}", "log.completions_every=0"])
    assert grpo_config_kwargs(resolve(off, detect()), "/tmp/unused")["log_completions"] is False


def test_tensorboard_gets_the_completions_as_text(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(*TINY, "--max-steps", "2", "--set", "eval.enabled=false", "--set", "train.report_to=tensorboard",
                   "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = b"".join(p.read_bytes() for p in out.rglob("events.out.tfevents.*"))
    assert events.count(b"completions/text_summary") == 2  # the text panel's entry of each written step
    rows = _rows(out / "completions.jsonl")
    assert f"| {rows[0]['group']} | {rows[0]['reward']:.3f} |".encode() in events


def test_the_curve_is_on_by_default_where_it_costs_under_a_tenth_and_dry_run_says_which(tmp_path):
    """resolve.choose_validation: null (auto) is on with the smallest interval whose points (step 0, every N-th, the
    last) are estimated under 10% of GRPO's time (the default CPU job: steps 0 and 48, 2 x 32 validation answers
    against 48 steps x 16 completions; every 24 steps would add a third point, 12.5%), off where even the two points
    of step 0 and the last cost more (tiny: 3 steps of 4 completions); as asked otherwise; --dry-run prints it."""
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import profile
    from lowvram_grpo.settings.resolve import VALIDATION_BUDGET, resolve, validation_cost

    default = resolve(load_config("smollm2_cpu"), profile("cpu"))
    assert default.validation_every == 48 and validation_cost(48, 48, 32, 16) == pytest.approx(64 / 768)
    assert validation_cost(24, 48, 32, 16) == pytest.approx(96 / 768)  # step 0, 24 and 48: 12.5%
    assert validation_cost(24, 48, 32, 16) > VALIDATION_BUDGET
    assert "eval.every_steps auto -> 48: a held-out curve on 32 validation questions, estimated 8% of GRPO's time" in \
        " ".join(default.notes)
    assert resolve(load_config("tiny"), profile("cpu")).validation_every == 0
    assert resolve(load_config("tiny", ["eval.every_steps=2"]), profile("cpu")).validation_every == 2
    assert resolve(load_config("smollm2_cpu", ["eval.every_steps=0"]), profile("cpu")).validation_every == 0
    assert resolve(load_config("smollm2_cpu", ["eval.enabled=false"]), profile("cpu")).validation_every == 0
    assert resolve(load_config("smollm2_cpu"), profile("cpu"), num_processes=2).validation_every == 0
    proc = run_cli(*TINY, "--dry-run", "--output-dir", str(tmp_path / "never"), env=ENV)
    assert proc.returncode == 0 and "note: eval.every_steps auto -> off: a held-out curve of two points" in proc.stdout
    assert not (tmp_path / "never").exists()
