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
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import stops
from .errors import RunDirError
from .evaluation import METRICS, WITH_INTERVAL, cell, intervals_overlap
from .run_dir import RunDir

BaselineError = RunDirError  # a run dir the baseline cannot be built from (exit 2)


def read_run(run_dir: Path) -> tuple:
    """(config, summary) of a finished run, read through RunDir."""
    folder = RunDir(run_dir)
    if not folder.file("config.yaml").is_file() or not folder.file("summary.json").is_file():
        raise RunDirError(f"{run_dir} has no config.yaml and summary.json: give the --output-dir of a finished run")
    summary = folder.read_summary()
    if summary.get("status") != "complete" or not summary.get("after"):
        raise RunDirError(f"{run_dir} is not a finished run with before/after numbers (status {summary.get('status')!r})")
    return folder.read_config(), summary


def training_seconds(summary: dict) -> float:
    """The wall time the GRPO run spent training: its priming plus its GRPO steps (no measuring)."""
    return float((summary.get("priming") or {}).get("seconds", 0.0)) + float(summary["train_seconds"])


def compare_table(summary: dict, prime_only: dict, label: str) -> str:
    """before | primed | after (GRPO) | prime-only, accuracies with their 95% Wilson intervals."""
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
            lines.append(f"{key} after (GRPO) - prime-only: {after[key] - prime_only[key]:+.3f}; the 95% intervals "
                         f"{'overlap' if overlap else 'do not overlap'}")
    return "\n".join(lines)


def run_baseline(run_dir: Path, steps: Optional[int] = None, backend: str = "auto", log=print) -> dict:
    from .backends import load_model, prepare_backend
    from .data import load_questions, to_prompt_rows
    from .evaluation import evaluate
    from .hardware import detect
    from .priming import prime
    from .resolve import resolve

    run_dir = Path(run_dir)
    config, summary = read_run(run_dir)
    budget = training_seconds(summary)
    if backend == "auto":
        backend = summary.get("backend") or "auto"
    resolved = resolve(config, detect(), backend)
    train_questions, eval_questions = load_questions(config.data)
    prepare_backend(resolved.backend)
    handle = load_model(resolved)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config.prime.steps = steps if steps is not None else 10**9
    max_seconds = None if steps is not None else budget
    log(f"prime-only baseline for {run_dir}: " + (f"{steps} priming steps" if steps is not None else
        f"priming for {budget:.0f} s (the run's priming {summary['priming']['seconds'] if summary.get('priming') else 0} s "
        f"+ GRPO {summary['train_seconds']} s)"))
    priming = prime(handle, train_questions, config, log, max_seconds=max_seconds)
    if not priming["steps"]:
        raise RunDirError("the run's training data has no worked solutions to prime on: no prime-only baseline")
    out = RunDir(run_dir / "prime_only").create()
    adapter = handle.save_lora(out.adapter_dir)
    log(f"measuring the prime-only adapter ({priming['steps']} steps, {priming['seconds']} s) ...")
    eval_rows = to_prompt_rows(eval_questions, config.data.system_prompt)
    try:
        with stops.deferred("after this batch of answers"):  # a signal stops between batches (stops.py)
            numbers, texts = evaluate(handle, eval_rows, config, lora_request=handle.load_lora(adapter))
    except stops.StopRequested as exc:
        raise stops.StopRequested(exc.signum, f"stopped by {stops.name(exc.signum)} while measuring the prime-only "
                                              f"adapter: {adapter} is written, its numbers are not; run it again: "
                                              f"{stops.same_command()}") from None
    result = {"run_dir": str(run_dir), "budget_seconds": round(budget, 1), "priming": priming,
              "prime_only": numbers, "samples": texts[:2]}
    out.write_summary(result)
    log("\n" + compare_table(summary, numbers, f"prime-only {priming['steps']}"))
    return result


def main(argv=None) -> int:
    from .commands import ArgumentParser, guarded
    from .errors import ConfigError

    parser = ArgumentParser(prog="python -m lowvram_grpo.baseline",
                     description="Priming alone for the same wall time as a finished GRPO run.")
    parser.add_argument("run_dir", type=Path, help="the --output-dir of a finished python -m lowvram_grpo.run")
    parser.add_argument("--steps", type=int, help="prime exactly this many steps instead of for the run's training time")
    parser.add_argument("--backend", default="auto", choices=["auto", "unsloth", "hf"])
    args = parser.parse_args(argv)

    def body() -> int:
        if args.steps is not None and args.steps < 1:
            raise ConfigError("--steps must be >= 1")
        run_baseline(args.run_dir, args.steps, args.backend)
        return 0

    return guarded(body)


if __name__ == "__main__":
    raise SystemExit(main())
