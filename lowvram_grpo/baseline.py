"""The honest baseline for "priming + GRPO": priming alone, for the same wall time.

    python -m lowvram_grpo.baseline RUN_DIR               # prime for RUN_DIR's priming + GRPO seconds
    python -m lowvram_grpo.baseline RUN_DIR --steps 400   # exactly 400 priming steps (a reproduction)

RUN_DIR is a finished `python -m lowvram_grpo.run` run. Its `config.yaml` gives everything but GRPO: the
model, the LoRA and its seed, the data, the priming settings, the held-out questions and the sampling;
its `summary.json` gives the wall time it spent training (priming seconds + GRPO seconds) and its
before/primed/after numbers. The baseline starts a fresh LoRA on the same base, runs supervised priming
(priming.py, the same examples, batch and learning rate) for that same wall time instead of `prime.steps`
then GRPO, and measures it on the same held-out questions with the same sampling and seed
(evaluation.py). Measurement time is left out on both sides. Time the two on the same machine under
the same load (the shared CPU lock on the dev machine).

Writes RUN_DIR/prime_only/: `adapter/`, `summary.json` (`prime_only`: the numbers; `priming`: steps,
seconds, losses; `budget_seconds`) and prints the table: before | primed | after (GRPO) | prime-only.

The random-reward control (`--control random-reward`) asks what the reward itself taught: the run's GRPO again
from the same start (its primed adapter, else its --init-adapter, else the same fresh LoRA from lora.random_state),
with the same seed, steps, data order and settings (pipeline.GRPORun on the run's config.yaml), but every reward
function replaced by random values (rewards.random_reward): per completion an independent uniform draw on that
function's range, [0, its best score] for a built-in reward (rewards.REWARD_MAX), for a reward file's function or
a reward model the widest of the run's logged per-step mean +- std (metrics.jsonl), [0, 1] if it logged none;
seeded by train.seed, the step and the call, and never reading the completion. Each group then has spread like
real rewards, so every group has an advantage, and the advantages are pure noise: what the run gained over the
control is what its rewards taught, beyond what GRPO's updates, the KL term and the sampling do on their own. It
is measured like the run (evaluation.py: the same questions, protocol and reward functions for reward_mean).
Writes RUN_DIR/control_random_reward/ (`adapter/`, `config.yaml`, `metrics.jsonl`, `summary.json`).

Both record themselves in the run's own `summary.json` (`controls`: the column, after's paired changes over it,
McNemar p) and rebuild its `report.md`, which then shows after beside each control and one line saying what the
run added beyond it. A signal (Ctrl-C, SIGTERM, SIGHUP) stops either at its next safe point (stops.py): the run is
left as it was, and the line gives the command to run again.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

from lowvram_grpo.evaluate.evaluation import (
    METRICS,
    WITH_INTERVAL,
    beyond_line,
    cell,
    intervals_overlap,
    paired_against,
)
from lowvram_grpo.model.backends import load_model, prepare_backend
from lowvram_grpo.model.vllm import closes_engines_on_error
from lowvram_grpo.report.run_dir import RunDir
from lowvram_grpo.core import stops
from lowvram_grpo.core.commands import ArgumentParser, guarded
from lowvram_grpo.core.errors import ConfigError, Interrupted, RunDirError
from lowvram_grpo.run.pipeline import GRPORun
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve
from lowvram_grpo.task.data import load_questions, prompt_text, to_prompt_rows
from lowvram_grpo.task.rewards import logged_name, random_reward, reward_range

CONTROLS = ("random-reward",)
CONTROL_FOLDER = {"random-reward": "control_random_reward", "prime-only": "prime_only"}
RANDOM_REWARD_DEFINITION = (
    "the run's GRPO from the same start with the same seed, steps, data order and settings, every reward function "
    "replaced by random values: per completion an independent uniform draw on that function's range ([0, its best "
    "score] for a built-in reward; for another, the widest of the run's logged per-step mean +- std, [0, 1] if it "
    "logged none), seeded by train.seed, the step and the call, never reading the completion; so groups have spread "
    "like real rewards and the advantages are pure noise")

BaselineError = RunDirError  # a run dir the baseline cannot be built from (exit 2)


def read_run(run_dir: Path) -> tuple:
    """(config, summary) of a finished run, read through RunDir."""
    folder = RunDir(run_dir)
    if not folder.file("config.yaml").is_file() or not folder.file("summary.json").is_file():
        raise RunDirError(f"{run_dir} has no config.yaml and summary.json: give the --output-dir of a finished run")
    summary = folder.read_summary()
    if summary.get("status") != "complete" or not summary.get("after"):
        raise RunDirError(f"{run_dir} is not a finished run with before/after numbers "
                          f"(status {summary.get('status')!r})")
    return folder.read_config(), summary


def training_seconds(summary: dict) -> float:
    """The wall time the GRPO run spent training: its priming plus its GRPO steps (no measuring)."""
    return float((summary.get("priming") or {}).get("seconds", 0.0)) + float(summary["train_seconds"])


def compare_table(summary: dict, prime_only: dict, label: str) -> str:
    """before | primed | after (GRPO) | `label` (the prime-only baseline or a control), accuracies with their 95%
    Wilson intervals."""
    columns = [("before", summary["before"])]
    if summary.get("primed"):
        columns.append(("primed", summary["primed"]))
    columns += [("after (GRPO)", summary["after"]), (label, prime_only)]
    width = 22
    lines = [f"{'held-out metric':<24}" + "".join(f"{name:>{width}}" for name, _ in columns)]
    for key in METRICS:
        lines.append(f"{key:<24}" + "".join(f"{cell(row, key):>{width}}" for _, row in columns))
    after = summary["after"]
    for key in WITH_INTERVAL:
        if f"{key}_ci" in after and f"{key}_ci" in prime_only:
            overlap = intervals_overlap(after[f"{key}_ci"], prime_only[f"{key}_ci"])
            lines.append(f"{key} after (GRPO) - {label}: {after[key] - prime_only[key]:+.3f}; the 95% intervals "
                         f"{'overlap' if overlap else 'do not overlap'}")
    return "\n".join(lines)


def run_baseline(run_dir: Path, steps: Optional[int] = None, backend: str = "auto", log=print) -> dict:
    from lowvram_grpo.evaluate.evaluation import evaluate  # loads transformers
    from lowvram_grpo.training.priming import prime  # loads transformers

    run_dir = Path(run_dir)
    config, summary = read_run(run_dir)
    budget = training_seconds(summary)
    if backend == "auto":
        backend = summary.get("backend") or "auto"
    config.prime.steps = steps if steps is not None else 10**9  # before resolve: its plan primes this long
    resolved = resolve(config, detect(), backend)
    train_questions, eval_questions = load_questions(config.data)
    prepare_backend(resolved.backend)
    handle = load_model(resolved)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    max_seconds = None if steps is not None else budget
    log(f"prime-only baseline for {run_dir}: " + (f"{steps} priming steps" if steps is not None else
        f"priming for {budget:.0f} s "
        f"(the run's priming {summary['priming']['seconds'] if summary.get('priming') else 0} s "
        f"+ GRPO {summary['train_seconds']} s)"))
    priming = prime(handle, train_questions, resolved.plan.prime, log, max_seconds=max_seconds)
    if not priming["steps"]:
        raise RunDirError("the run's training data has no worked solutions to prime on: no prime-only baseline")
    out = RunDir(run_dir / "prime_only").create()
    adapter = handle.save_lora(out.adapter_dir)
    log(f"measuring the prime-only adapter ({priming['steps']} steps, {priming['seconds']} s) ...")
    eval_rows = to_prompt_rows(eval_questions, config.data.system_prompt)
    try:
        with stops.deferred("after this batch of answers"):  # a signal stops between batches (stops.py)
            numbers, texts = evaluate(handle, eval_rows, resolved.plan.eval, lora_request=handle.load_lora(adapter))
    except stops.StopRequested as exc:
        raise stops.StopRequested(exc.signum, f"stopped by {stops.name(exc.signum)} while measuring the prime-only "
                                              f"adapter: {adapter} is written, its numbers are not; run it again: "
                                              f"{stops.same_command()}") from None
    result = {"run_dir": str(run_dir), "budget_seconds": round(budget, 1), "priming": priming,
              "prime_only": numbers, "samples": texts[:2]}
    out.write_summary(result)
    log("\n" + compare_table(summary, numbers, f"prime-only {priming['steps']}"))
    record_control(run_dir, "prime-only", {
        "label": "prime-only baseline", "folder": CONTROL_FOLDER["prime-only"],
        "headline": "What GRPO added beyond priming alone for the same wall time",
        "about": f"Priming alone for the run's training time: {priming['steps']} priming steps "
                 f"in {priming['seconds']} s "
                 f"(budget {budget:.0f} s), files in `{CONTROL_FOLDER['prime-only']}/`.",
        "definition": "a fresh LoRA primed (supervised, the run's priming settings) for the run's priming + GRPO wall "
                      "time" if steps is None else f"a fresh LoRA primed for {steps} steps",
        "steps": priming["steps"], "seconds": priming["seconds"], "numbers": numbers}, log)
    return result


# ----------------------------------------------------------------------------- the random-reward control
def grpo_start(run_dir: Path, config, summary: dict) -> Optional[Path]:
    """The adapter the run's GRPO started from: its primed adapter when it primed, else its lora.init_adapter;
    None for a fresh LoRA (made from lora.random_state, as the control's will be)."""
    if (summary.get("priming") or {}).get("steps"):
        primed = RunDir(run_dir).primed_adapter_dir
        if not primed.is_dir():
            raise RunDirError(f"{run_dir} primed before GRPO but has no primed_adapter/ any more: the control cannot "
                              "start where the run's GRPO started")
        return primed
    return Path(config.lora.init_adapter) if config.lora.init_adapter else None


def random_ranges(run_dir: Path, config) -> dict[str, tuple[float, float]]:
    """Each reward's range for its random stand-in (see RANDOM_REWARD_DEFINITION)."""
    rows = RunDir(run_dir).read_metrics(required=False)
    ranges = {}
    for name in config.rewards.names:
        known = reward_range(name)
        if known is not None:
            ranges[name] = known
            continue
        key = f"rewards/{logged_name(name)}"
        spans = [(row[f"{key}/mean"] - (row.get(f"{key}/std") or 0.0),
                  row[f"{key}/mean"] + (row.get(f"{key}/std") or 0.0))
                 for row in rows if isinstance(row.get(f"{key}/mean"), (int, float))]
        ranges[name] = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0.0, 1.0)
    return ranges


def record_control(run_dir: Path, name: str, entry: dict, log=print) -> None:
    """The control in the run's summary.json (`controls[name]`: `entry` + after's paired changes over it) and the
    run's report.md rebuilt (report.controls_section); logs the one line."""
    from lowvram_grpo.report.build import write_report  # loads transformers

    folder = RunDir(run_dir)
    with stops.deferred("once the run's summary and report are written", check_at_exit=False):  # then it is done
        summary = folder.read_summary()
        entry = {**entry, "paired": paired_against(entry["numbers"], summary["after"])}
        summary.setdefault("controls", {})[name] = entry
        folder.write_summary(summary)
        report = write_report(run_dir)
    log(beyond_line(entry["headline"], entry["numbers"], summary["after"]))
    log(f"recorded in {folder.file('summary.json')} (controls.{name}) and {report}")


def run_control(run_dir: Path, control: str = "random-reward", backend: str = "auto", log=print) -> dict:
    """Train and measure `control` for the finished run in `run_dir` (see the module's docstring); returns the
    control's summary. A vLLM engine started for it ends with it when it raises."""

    if control not in CONTROLS:

        raise ConfigError(f"unknown control {control!r}: choose {', '.join(CONTROLS)}")
    return closes_engines_on_error(_run_control)(Path(run_dir), control, backend, log)


def _run_control(run_dir: Path, control: str, backend: str, log) -> dict:
    config, summary = read_run(run_dir)
    start = grpo_start(run_dir, config, summary)
    overrides = ["prime.steps=0"] + ([f"lora.init_adapter={json.dumps(str(start))}"] if start is not None else [])
    control_config = load_config(str(RunDir(run_dir).file("config.yaml")), overrides)
    ranges = random_ranges(run_dir, config)
    if backend == "auto":
        backend = summary.get("backend") or "auto"
    out = run_dir / CONTROL_FOLDER[control]
    started_from = str(start) if start is not None else f"a fresh LoRA (lora.random_state {config.lora.random_state})"
    log(f"random-reward control for {run_dir}: {config.train.max_steps} GRPO steps from {started_from}, seed "
        f"{config.train.seed}, every reward random on its range: "
        + ", ".join(f"{name} [{low:g}, {high:g}]" for name, (low, high) in ranges.items()))
    run = RunDir(run_dir).lock()  # the run's files do not change under the control (a second control waits)
    grpo = None
    try:
        grpo = GRPORun(control_config, out, backend, log, existing="overwrite")
        grpo.trainer_rewards = [random_reward(name, *ranges[name], seed=config.train.seed)
                                for name in control_config.rewards.names]
        grpo.load()
        with stops.deferred():  # from here a signal stops at the next safe point
            grpo.start()
            grpo.run_dir.write_summary({"status": "training", "control": control, "of_run": str(run_dir),
                                        "backend": grpo.resolved.backend})
            grpo.train()
            grpo.save()
            numbers = grpo.measure("after", grpo.adapter_dir)
        steps, seconds = grpo.trainer.state.global_step, round(grpo.train_seconds, 2)
        result = {"status": "complete", "control": control, "of_run": str(run_dir),
                  "definition": RANDOM_REWARD_DEFINITION,
                  "start": started_from, "random_ranges": {k: list(v) for k, v in ranges.items()}, "steps": steps,
                  "train_seconds": seconds, "backend": grpo.resolved.backend, "control_random_reward": numbers,
                  "paired": paired_against(numbers, summary["after"]),
                  "samples": [{"question": prompt_text(row["prompt"]), "answer": row.get("answer"), "trained": text}
                              for row, text in list(zip(grpo.eval_rows, grpo.texts["after"]))[:2]]}
        grpo.run_dir.write_summary(result)
        log("\n" + compare_table(summary, numbers, "random-reward control"))
        record_control(run_dir, control, {
            "label": "random-reward control", "folder": CONTROL_FOLDER[control],
            "headline": "What the reward added beyond the random-reward control",
            "about": f"The run's GRPO again with random rewards: {steps} steps in {seconds} s from {started_from}, "
                     f"files in `{CONTROL_FOLDER[control]}/`.",
            "definition": RANDOM_REWARD_DEFINITION, "steps": steps, "train_seconds": seconds, "numbers": numbers}, log)
        return result
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = (getattr(exc, "signum", None) or stops.received() or (getattr(exc, "exit_code", 130) - 128)
                  or signal.SIGINT)
        raise stops.StopRequested(signum, f"stopped by {stops.name(signum)} during the random-reward control of "
                                          f"{run_dir}: the run is unchanged, and the control's partial files in {out} "
                                          f"are replaced when it runs again: {stops.same_command()}") from None
    finally:
        if grpo is not None:
            grpo.release()
        run.unlock()


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m lowvram_grpo.baseline",
                     description="Priming alone for the same wall time as a finished GRPO run, or (--control "
                                 "random-reward) the run's GRPO again with random rewards.")
    parser.add_argument("run_dir", type=Path, help="the --output-dir of a finished python -m lowvram_grpo.run")
    parser.add_argument("--steps", type=int,
                        help="prime exactly this many steps instead of for the run's training time")
    parser.add_argument("--control", choices=CONTROLS,
                        help="instead of the prime-only baseline: random-reward = the run's GRPO again from the same "
                             "start with every reward replaced by random values, measured the same way")
    parser.add_argument("--backend", default="auto", choices=["auto", "unsloth", "hf"])
    args = parser.parse_args(argv)

    def body() -> int:
        if args.steps is not None and args.steps < 1:
            raise ConfigError("--steps must be >= 1")
        if args.control is not None:
            if args.steps is not None:
                raise ConfigError("--steps is the prime-only baseline's; the control trains the run's own "
                                  "train.max_steps: drop --steps")
            run_control(args.run_dir, args.control, args.backend)
            return 0
        run_baseline(args.run_dir, args.steps, args.backend)
        return 0

    return guarded(body)


if __name__ == "__main__":
    raise SystemExit(main())
