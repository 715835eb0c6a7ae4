"""One training run, start to finish: data -> model -> rewards -> trainer -> adapter -> before/after.

`run(config, output_dir, backend)` is the Python entry point (the CLI and the notebook call it). It
reads straight through; each step lives in its own module:

    data.load_questions        where the questions come from          (data.py)
    backends.load_model        where the 4-bit/LoRA model is built    (backends/)
    rewards.REWARDS            where rewards are computed             (rewards.py)
    training.build_trainer     TRL's GRPOTrainer with our callbacks   (training.py)
    handle.save_lora           where the adapter is written           (lora_io.py)
    evaluation.evaluate        the before/after numbers               (evaluation.py)
    report.write_report        report.md + PNG plots + warnings       (report.py)

Outputs in `output_dir`: config.yaml (resolved), metrics.jsonl, adapter/ (PEFT), summary.json,
report.md and the plots (reward.png, kl.png, completion_length.png, clipped_ratio.png, loss.png).
Bad input is rejected before anything is written (`ConfigError`, `DataError`, `BackendError`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .backends import check_export, export_model, load_model, prepare_backend
from .config import ConfigError, RunConfig
from .hardware import detect
from .resolve import resolve as resolve_settings
from .data import DataError, drop_long_prompts, load_questions, to_prompt_rows
from . import checkpoints
from .lora_io import atomic_write_text
from .memory import out_of_memory_reported
from .rewards import RewardError


@dataclass
class RunResult:
    output_dir: Path
    adapter_dir: Path
    summary: dict
    handle: object = field(repr=False, default=None)


def show_memory_plan(resolved, log):
    """On CUDA: log the memory plan for the card present (or memory.vram_gb) and return it; None on CPU."""
    if not resolved.cuda:
        return None
    from .memory import PlanError, format_plan, plan

    try:
        memory_plan = plan(resolved)
    except PlanError as exc:
        log(f"memory plan: {exc}")
        return None
    log(format_plan(memory_plan))
    if memory_plan.fits is False:
        log("warning: the memory plan does not fit this card; --auto-fit applies the settings above")
    return memory_plan


def check_output_dir(path: Path) -> Path:
    """Refuse an output dir that cannot be created, writing nothing (it is made just before the first write)."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if existing == path and not path.is_dir():
        problem = "it is a file"
    elif existing != path and not existing.is_dir():
        problem = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    if problem:
        raise ConfigError(f"cannot create output dir {path}: {problem}; pass a writable --output-dir")
    return path


def prepare_output_dir(path: Path) -> Path:
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot create output dir {path}: {exc.strerror or exc}; pass a writable --output-dir") from None
    return path


def run(config: RunConfig, output_dir: Path, backend: str = "auto", log=print, handle=None,
        resume_from: Optional[Path] = None, export: Optional[str] = None) -> RunResult:
    """`handle`: a model already loaded by `backends.load_model` for this config (the notebook loads it
    in its own cell); it is trained in place instead of loading a second copy. `resume_from`: a
    checkpoint in `output_dir` to continue this run from (see `resume`). `export`: merged16 or gguf,
    the model with the adapter merged in, written to `output_dir/export-KIND` after training."""
    started = time.time()
    resolved = handle.resolved if handle is not None else resolve_settings(config, detect(), backend)
    backend = resolved.backend
    check_export(export, backend)

    # Data: questions in, held-out split aside. Fails before anything is written.
    train_questions, eval_questions = load_questions(config.data)
    output_dir = check_output_dir(output_dir)  # created below, once model and data have been accepted

    memory_plan = show_memory_plan(resolved, log)  # before every GPU run, before the model takes memory

    # Model: unsloth must be imported before trl/transformers, so the backend goes first.
    prepare_backend(backend)
    if handle is None:
        handle = load_model(resolved, log)
    resolved = handle.resolved  # unsloth may load another dtype than asked: mixed precision follows it
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = resolved.cuda
    log(resolved.describe())
    log(f"{config.model.name} (4-bit: {resolved.load_in_4bit}): {handle.trainable_parameters():,} trainable LoRA parameters")

    train_rows, dropped = drop_long_prompts(
        to_prompt_rows(train_questions, config.data.system_prompt), handle.tokenizer, config.train.max_prompt_length
    )
    if not train_rows:
        raise DataError(f"every training prompt is longer than train.max_prompt_length={config.train.max_prompt_length} tokens: raise it")
    if dropped:
        log(f"dropped {dropped} prompts longer than train.max_prompt_length={config.train.max_prompt_length}")
    eval_rows = to_prompt_rows(eval_questions, config.data.system_prompt)

    # Rewards are named in the config; TRL calls them (training.build_trainer).
    from .evaluation import evaluate, format_table
    from .training import build_trainer

    output_dir = prepare_output_dir(output_dir)  # the first write: bad input was refused before this
    trainer = build_trainer(handle, train_rows, output_dir)
    from .training import describe_effective

    log(describe_effective(trainer.effective_settings))
    if resume_from is None:
        atomic_write_text(output_dir / "config.yaml", config.to_yaml())
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)  # a rerun into the same dir starts its log afresh
        before, before_texts, primed, priming = measure_and_prime(handle, config, train_questions, eval_rows, output_dir, log)
        write_start_summary(output_dir, backend, before, before_texts, primed, priming)
    else:  # the log, the guard's counters and the start numbers as they were: no measuring or priming again
        checkpoints.restore_metrics(resume_from, output_dir / "metrics.jsonl")
        trainer.nonfinite_guard.load(checkpoints.read_run_state(resume_from))
        before, before_texts, primed, priming = read_start_summary(output_dir)
        log(f"resuming from {resume_from}")

    train_started = time.time()
    try:
        with trainer.stop_signals.installed(), out_of_memory_reported(memory_plan, output_dir):  # Ctrl-C / SIGTERM: stop at the step's end with a checkpoint
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except RewardError as exc:
        raise checkpoints.TrainingStopped(f"{exc}; {_resume_hint(output_dir)}") from None
    except RuntimeError as exc:  # NaN/inf weights make sampling fail: say so instead of torch's message
        stopped = trainer.nonfinite_guard.explain(exc, trainer.state)
        if stopped is None:
            raise
        raise stopped from None
    train_seconds = time.time() - train_started
    trainer.nonfinite_guard.raise_if_stopped(trainer.state, checkpoints.latest_checkpoint(output_dir))

    adapter_dir = handle.save_lora(output_dir / "adapter")
    trainer.stop_signals.raise_if_stopped(trainer.state, output_dir, adapter_dir)

    after, after_texts = (None, [])
    if config.eval.enabled:
        log("measuring the trained adapter (loaded back from disk) ...")
        after, after_texts = evaluate(handle, eval_rows, config, lora_request=handle.load_lora(adapter_dir))
    if export:
        log(f"exported ({export}): {export_model(handle, adapter_dir, output_dir / f'export-{export}', export)}")

    summary = {
        "status": "complete",
        "preset": config.preset,
        "backend": backend,
        "device": "cuda" if cuda else "cpu",
        "model": config.model.name,
        "steps": trainer.state.global_step,
        "train_seconds": round(train_seconds, 2),
        "total_seconds": round(time.time() - started, 2),
        "before": before,
        "primed": primed,
        "after": after,
        "priming": priming,
        "resolved": resolved.summary(),
        "grpo_settings": trainer.effective_settings,
        "skipped_nonfinite": trainer.nonfinite_guard.skipped,
        "reward_failures": {f.__name__: f.failures for f in trainer.reward_funcs if getattr(f, "failures", 0)},
        "samples": [
            {"question": row["prompt"][-1]["content"], "answer": row["answer"], "base": b, "trained": a}
            for row, b, a in list(zip(eval_rows, before_texts, after_texts))[:2]
        ],
    }
    atomic_write_text(output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if before and after:
        log("\n" + format_table(before, after, primed))
        for sample in summary["samples"]:
            log(f"\nQ: {sample['question']}  (gold: {sample['answer']})")
            log(f"--- base ---\n{sample['base'].strip()}\n--- trained ---\n{sample['trained'].strip()}")
    from .report import write_report

    report = write_report(output_dir)  # report.md + plots from metrics.jsonl and summary.json
    log(f"\nadapter: {adapter_dir}\nsummary: {output_dir / 'summary.json'}\nreport:  {report}")
    return RunResult(output_dir=output_dir, adapter_dir=adapter_dir, summary=summary, handle=handle)


def measure_and_prime(handle, config: RunConfig, train_questions, eval_rows, output_dir: Path, log) -> tuple:
    """The base model's held-out numbers, then the optional supervised priming (priming.py says why: so
    GRPO's groups have rewards that differ) and the primed adapter's numbers."""
    from .evaluation import evaluate

    before, before_texts = (None, [])
    if config.eval.enabled:
        log(f"measuring the base model on {len(eval_rows)} held-out questions ...")
        before, before_texts = evaluate(handle, eval_rows, config, lora_request=None)

    priming, primed = None, None
    if config.prime.steps > 0:
        from .priming import prime

        priming = prime(handle, train_questions, config, log)
        primed_dir = handle.save_lora(output_dir / "primed_adapter")
        if config.eval.enabled:
            log("measuring the primed adapter ...")
            primed, _ = evaluate(handle, eval_rows, config, lora_request=handle.load_lora(primed_dir))
    return before, before_texts, primed, priming


def write_start_summary(output_dir: Path, backend: str, before, before_texts, primed, priming) -> None:
    """summary.json while training runs: the numbers measured before GRPO, which a resumed run reuses."""
    start = {"status": "training", "backend": backend, "before": before, "before_texts": before_texts,
             "primed": primed, "priming": priming}
    atomic_write_text(output_dir / "summary.json", json.dumps(start, indent=2) + "\n")


def read_start_summary(output_dir: Path) -> tuple:
    try:
        start = json.loads((output_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        start = {}
    return start.get("before"), start.get("before_texts", []), start.get("primed"), start.get("priming")


def _started_backend(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("backend") or "auto"
    except (OSError, json.JSONDecodeError):
        return "auto"


def _resume_hint(run_dir: Path) -> str:
    if checkpoints.latest_checkpoint(run_dir) is None:
        return "no checkpoint was written yet: fix it and start the run again"
    return f"fix it and continue from the last checkpoint with: {checkpoints.resume_command(run_dir)}"


def resume(run_dir: Path, backend: str = "auto", log=print) -> RunResult:
    """Continue the run in `run_dir` (`--resume`) from its newest complete checkpoint to its configured end."""
    run_dir = Path(run_dir)
    config = checkpoints.resumable_config(run_dir)
    started = _started_backend(run_dir)  # backends differ in their optimizers' saved states
    if backend == "auto":
        backend = started
    elif started != "auto" and backend != started:
        raise ConfigError(f"--resume {run_dir}: the run started on the {started} backend; "
                          f"resume it with --backend {started} (or leave --backend out)")
    checkpoints.remove_leftovers(run_dir)
    checkpoint = checkpoints.latest_checkpoint(run_dir)
    if checkpoint is None:
        log(f"no complete checkpoint in {run_dir} yet: running it again from the start")
    return run(config, run_dir, backend, log, resume_from=checkpoint)


def default_output_dir(preset: str) -> Path:
    return Path("outputs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def train(preset: str = "tiny", overrides: Optional[list[str]] = None, output_dir: Optional[str] = None,
          backend: str = "auto") -> RunResult:
    """Python entry point: `lowvram_grpo.train("tiny", ["train.max_steps=3"], "runs/x")`."""
    from .config import load_config

    config = load_config(preset, overrides or [])
    return run(config, Path(output_dir) if output_dir else default_output_dir(config.preset), backend)
