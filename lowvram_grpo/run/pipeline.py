"""One training run, start to finish, as named steps: `run()` reads straight through.

    grpo = GRPORun(config, "runs/x")   # settings decided (resolve.py), data read, output dir checked: nothing heavy,
                                         nothing written
    grpo.load()                        # the 4-bit/LoRA model (backends/), prompts that fit
    grpo.start()                       # the output dir, config.yaml, a fresh metrics.jsonl
    grpo.measure("before")             # the base model on the held-out questions (evaluation.py)
    grpo.prime()                       # optional supervised priming (priming.py) + measure("primed")
    grpo.train()                       # the held-out curve's step 0 (validation.py), then TRL's GRPOTrainer with our
                                         callbacks (grpo.py)
    grpo.save()                        # adapter/ (lora_io.py)
    grpo.measure("after")              # the trained adapter, loaded back from disk
    grpo.export("merged16")            # optional merged model (backends.export_model)
    result = grpo.finish()             # summary.json + report.md and plots (report/build.py)

The notebook calls the same steps, one per cell. `resume()` continues a killed run from its newest
checkpoint: the numbers measured before GRPO come back from summary.json instead of being measured again;
a run stopped in priming continues its priming from prime-checkpoint-N.

Stops (stops.py): SIGINT, SIGTERM and SIGHUP stop `run()` at the next safe point of the phase it is in
(while loading: at once, nothing is written yet; between measuring batches; between priming steps, with
a priming checkpoint; at a GRPO step's end, with a checkpoint; after a save, an export or the report), as
one `Interrupted` line naming what is kept and the command that goes on (exit 128 + signal).

Where things happen: data enters in data.py, settings are decided in resolve.py, the model is built
in backends/, rewards are computed in rewards.py, every file of the run is written through
run_dir.RunDir. Bad input is refused in `GRPORun(...)` and `load()`, before the output dir exists.
Under `accelerate launch` every process runs these steps on its own copy of the model (TRL makes the
GRPO step data-parallel); only the main process writes files.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lowvram_grpo.model.backends import check_export, check_export_fits_host, export_model, load_model, prepare_backend
from lowvram_grpo.model.builtin_models import resolve_model_path
from lowvram_grpo.model.lora_io import load_adapter_weights
from lowvram_grpo.model.unsloth_backend import rollout_files_moved_to
from lowvram_grpo.model.vllm import check_run_servable, closes_engines_on_error
from lowvram_grpo.training.vllm_rollouts import start_for_run
from lowvram_grpo.report.model_card import write_card
from lowvram_grpo.report.peak_memory import RUN_PEAK, describe
from lowvram_grpo.report.records import START_KEY, start_text
from lowvram_grpo.report.run_dir import RunDir, resume_command
from lowvram_grpo.core import allocator, stops
from lowvram_grpo.core.errors import (
    ConfigError,
    DataError,
    EngineStopped,
    Interrupted,
    LowvramError,
    RewardError,
    TrainingStopped,
)
from lowvram_grpo.run.oom import OOM_PHASES, out_of_memory_reported
from lowvram_grpo.core.stops import StopRequested
from lowvram_grpo.settings import checks
from lowvram_grpo.settings.installed import log_lines
from lowvram_grpo.settings.config import RunConfig, check_trackers_installed, load_config
from lowvram_grpo.settings.plans import RunPlan, run_plan
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.memory_plan import PlanError, format_plan, plan, run_plan_text
from lowvram_grpo.settings.resolve import resolve as resolve_settings
from lowvram_grpo.task.data import (
    drop_long_prompts,
    load_questions,
    prompt_text,
    prompt_tokens,
    to_prompt_rows,
    validation_questions,
)
from lowvram_grpo.task.reward_models import load_reward_models
from lowvram_grpo.task.rewards import check_rewards
from lowvram_grpo.task.tools import check_tool_prompts
from lowvram_grpo.task.user_code import load as load_user_code
from lowvram_grpo.training.validation import Validation

STAGES = ("before", "primed", "after", "best")  # best: best_adapter/ (the held-out
                                                # curve's best) on the held-out questions


@dataclass
class RunResult:
    output_dir: Path
    adapter_dir: Path
    summary: dict
    handle: object = field(repr=False, default=None)


def _is_main_process() -> bool:
    """False on the other processes of an `accelerate launch` (they train, but write nothing)."""
    return int(os.environ.get("RANK", "0")) == 0


class GRPORun:
    """One run. `__init__` decides the settings once and checks the inputs (nothing heavy is imported,
    nothing is written); each step after it is a method. Numbers measured go to `self.measured`."""

    # The reward functions GRPO trains with when they are not the configured ones (which still score the held-out
    # numbers): the random-reward control (baseline.run_control). None = the configured ones.
    trainer_rewards: Optional[list] = None

    def __init__(self, config: RunConfig, output_dir, backend: str = "auto", log=print, hardware=None,
                 export: Optional[str] = None, existing: str = "refuse"):
        """`existing`: what to do with a run already in `output_dir`: 'refuse' it (RunDirError saying how to go
        on), 'overwrite' it (its files are deleted at the first write, in start()), or 'resume' it."""
        self.started = time.time()
        self.log = log if _is_main_process() else (lambda *args, **kwargs: None)  # one process speaks
        self.warn = (lambda line: print(line, file=sys.stderr)) if _is_main_process() else self.log
        self.run_dir = RunDir(output_dir, writer=_is_main_process())
        self.run_dir.check_creatable()  # created in start(), once the model and the data have been accepted
        if existing != "resume":  # a run there (finished, stopped, running) is never silently replaced
            self.run_dir.check_free(overwrite=existing == "overwrite")
        self.overwrite = existing == "overwrite"
        check_trackers_installed(config.train)
        plan = run_plan(config)  # the phases' settings, built once for the run: the checks and resolve read this one
        self.user = load_user_code(plan)  # the user's reward, tool and environment files: imported and looked up once
        checks.before_load(config, plan)  # settings that cannot work together (lengths, LoRA vs the model's shape)
        self.resolved = resolve_settings(config, hardware or detect(), backend, num_processes=_num_processes(),
                                         plan=plan)
        self.user_config = config  # written to config.yaml and plan.txt, and read by the memory plan's
                                   # suggestions and an out-of-memory line only: the steps read the plan
        check_export(export, self.resolved.backend)
        check_export_fits_host(export, plan.model.facts, self.resolved.backend)  # before the model downloads,
                                                                                  # not after training
        if self.resolved.generation == "vllm":

            check_run_servable(self.resolved)  # a model vLLM's CPU build has no kernels for: refused now
        self.export_kind = export
        # offline, a hub model not in the cache cannot load: said after what resolve refuses (a GPU preset without a
        # GPU, a model our engine cannot serve), as the command line says those first too
        checks.check_offline_model(config.model.name)
        self.train_questions, self.eval_questions = load_questions(config.data)  # data in; fails before any write
        self.validation_questions: list = []  # the held-out curve's (validation.py): out of training, not held-out ones
        if self.resolved.validation_every:
            self.train_questions, self.validation_questions = validation_questions(
                config.data, self.train_questions, self.eval_questions, config.eval.validation_size)
        check_rewards(config.rewards, to_prompt_rows(self.train_questions, config.data.system_prompt),
                      config.data.dataset or "built-in problems", self.user.reward_fns)  # as TRL will call
                                                                                         # each, on this data
        if config.uses_tools:  # TRL runs tools for chat-message prompts only
            check_tool_prompts(to_prompt_rows(self.train_questions[:1], config.data.system_prompt),
                               config.data.dataset or "built-in problems")
        for warning in checks.surprises(config, len(self.train_questions)):
            self.warn(warning)
        self.run_dir.lock()  # a second process writing this folder is refused from here on, until release()
        self.locked = self.run_dir.writer
        self.phase = "loading"  # where a stop lands (stopped()); each step names its own
        self.written = existing == "resume"  # does the folder hold this run's files (start() writes the first)
        self.handle = None
        self.rollouts = None  # model.generation=vllm: rollouts (and evaluation) from our vLLM engine
        self.trainer = None
        self.memory_plan = None
        self.measured: dict[str, Optional[dict]] = {stage: None for stage in STAGES}
        self.texts: dict[str, list[str]] = {stage: [] for stage in STAGES}
        self.priming: Optional[dict] = None
        self.train_seconds = 0.0
        self.answer_seconds: Optional[float] = None  # a held-out answer's seconds, measured (measure)
        self.decode_graphs: Optional[dict] = None  # unsloth's decode CUDA-graph counters
                                                   # after GRPO (CUDA, unsloth backend)
        self.adapter_dir: Optional[Path] = None

    @property
    def plan(self) -> RunPlan:
        """The phases' settings (plans.RunPlan): what priming, training and the measurements are handed."""
        return self.resolved.plan

    # ------------------------------------------------------------------ load
    def load(self, handle=None):
        """The model (or `handle`, one loaded already by `backends.load_model` for these settings: the
        notebook loads it in its own cell) and the prompts that fit train.max_prompt_length."""
        if handle is not None:
            self.resolved = handle.resolved
        if self.resolved.cuda and _is_main_process():  # the first lines of a GPU run's log: doctor's cheap checks

            for line in log_lines(self.resolved):
                self.log(line)
        self.memory_plan = self._show_memory_plan()  # before every GPU run, before the model takes memory
        prepare_backend(self.resolved.backend)  # unsloth must be imported before trl/transformers
        if handle is None:
            self._check_prompts(self._tokenizer_alone())  # with the tokenizer alone: refused before the weights load
        self.handle = handle or load_model(self.resolved, self.log)
        self.resolved = self.handle.resolved  # unsloth may load another dtype than asked: mixed precision follows it
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.log(self.resolved.describe())
        note = allocator.mismatch_note(self.resolved.host_allocator, self.resolved.hardware.mimalloc_library)
        if note:
            self.log(note)
        self.log(f"{self.plan.model.name} (4-bit: {self.resolved.load_in_4bit}): "
                 f"{self.handle.trainable_parameters():,} trainable LoRA parameters")
        if self.plan.model.init_adapter:
            lora = self.plan.model
            self.log(f"starting from the adapter in {lora.init_adapter} (r={lora.lora_r}, alpha={lora.lora_alpha}, "
                     f"target_modules={','.join(lora.lora_target_modules)})")
        load_reward_models(self.plan.rewards)  # reward models named in rewards.names, before anything is written
        if self.resolved.generation == "vllm":

            with stops.deferred("once the vLLM engine has started"):  # then it is closed, not left behind
                self.rollouts = start_for_run(self.handle, self.log)  # also the handle's engine for evaluation
        self._check_prompts(self.handle.text_tokenizer)  # the loaded model's tokenizer decides which prompts are kept
        tools = self.user.prompt_tools()  # their schemas (the environment's methods
                                          # too) are in every prompt TRL renders
        limit = self.plan.prompts.max_prompt_length
        rows = to_prompt_rows(self.train_questions, self.plan.prompts.system_prompt)
        self.train_rows, dropped = drop_long_prompts(rows, self.handle.tokenizer, limit, tools,
                                                     self.plan.prompts.template_kwargs)
        if dropped:
            self.log(f"dropped {dropped} prompts longer than train.max_prompt_length={limit}")
        self.eval_rows = to_prompt_rows(self.eval_questions, self.plan.prompts.system_prompt)
        self.validation_rows = to_prompt_rows(self.validation_questions, self.plan.prompts.system_prompt)
        return self.handle

    def _tokenizer_alone(self):
        """The model's tokenizer without its weights (seconds, a few MB), for the checks that need only it; None
        where it does not load on its own (the model's loader then says why, as it always has)."""
        from transformers import AutoTokenizer


        try:
            return AutoTokenizer.from_pretrained(resolve_model_path(self.plan.model.name))
        except Exception:  # noqa: BLE001 (a hub error, a tokenizer only the backend's loader can build)
            return None

    def _check_prompts(self, tokenizer) -> None:
        """Chat prompts have a chat template (checks.check_chat_template); with tools, the chat template renders and
        parses tool calls; some training prompt fits
        train.max_prompt_length (with the tools' schemas, which TRL renders into every prompt)."""
        if tokenizer is None:
            return
        rows = to_prompt_rows(self.train_questions, self.plan.prompts.system_prompt)
        checks.check_chat_template(self.plan, tokenizer, any(not isinstance(r["prompt"], str) for r in rows))
        checks.check_tool_template(self.plan, tokenizer)
        tools = self.user.prompt_tools()
        limit = self.plan.prompts.max_prompt_length
        lengths = (prompt_tokens(tokenizer, row["prompt"], tools, self.plan.prompts.template_kwargs) for row in rows)
        shortest = None
        for length in lengths:  # stops at the first prompt that fits
            if length <= limit:
                return
            shortest = length if shortest is None else min(shortest, length)
        with_tools = " (with the tools' schemas, which TRL renders into every prompt)" if tools else ""
        completion = self.plan.train.max_completion_length
        raise DataError(f"every training prompt is longer than train.max_prompt_length={limit} tokens{with_tools}; "
                        f"the shortest is {shortest}: set train.max_prompt_length={shortest} or more (and "
                        f"model.max_seq_length to at least that + train.max_completion_length={completion})")

    def _show_memory_plan(self):
        if not self.resolved.cuda:
            return None

        try:
            memory_plan = plan(self.user_config, self.resolved)
        except PlanError as exc:
            self.log(f"memory plan: {exc}")
            return None
        self.log(format_plan(memory_plan))
        if memory_plan.fits is False:
            self.log("warning: the memory plan does not fit this card; --auto-fit applies the settings above")
        return memory_plan

    # ------------------------------------------------------------------ start / restore
    def start(self) -> None:
        """The first write: the output dir, config.yaml, a fresh metrics.jsonl, the start summary (with
        `existing='overwrite'`, the run that was there is deleted first)."""
        self._enter("starting")
        if self.overwrite:
            self.run_dir.clear_run()
        self.written = True
        self.run_dir.create()
        self._write_settings()
        self.run_dir.reset_metrics()  # a rerun into the same dir starts its log afresh
        self.run_dir.reset_completions()
        self.run_dir.reset_best()
        self.run_dir.reset_curve_start()
        self.run_dir.write_summary(self._start_summary())

    def _start_summary(self) -> dict:
        """What --resume reads back: the backend and export the run started with, the numbers measured before GRPO."""
        return {"status": "training", "backend": self.resolved.backend, "export": self.export_kind,
                "before": self.measured["before"], "before_texts": self.texts["before"],
                "primed": self.measured["primed"], "priming": self.priming}

    @contextlib.contextmanager
    def _failures_reported(self, phase: str):
        """What only a GPU or the vLLM engine raises, in `phase`, as one line that says what is kept and how
        to go on: a CUDA out-of-memory (oom.py), the vLLM engine's process dying (OutOfMemory, EngineStopped).
        A stop is never an engine failure: a StopRequested raised inside vLLM's frames, or any error once a signal
        was received (vLLM's processes end on the same SIGTERM), leaves as StopRequested for the stop line."""

        with out_of_memory_reported(self.memory_plan, self.user_config, self.run_dir, phase, adapter=self.adapter_dir):
            try:
                yield
            except Exception as exc:
                if isinstance(exc, StopRequested):  # raised inside vLLM's frames (a second Ctrl-C): the stop line
                    raise
                if stops.received() is not None:  # what vLLM made of the stop (its processes got the same SIGTERM)
                    raise StopRequested(stops.received()) from None
                if self.rollouts is None and not self.resolved.fast_inference:  # no vLLM engine in this run
                    raise
                from lowvram_grpo.model.vllm import engine_stop_cause  # optional: may be absent

                cause = engine_stop_cause(exc)
                if cause is None and self.resolved.fast_inference:  # unsloth's engine runs in this process
                    from lowvram_grpo.model.unsloth_backend import vllm_engine_failure  # optional: may be absent

                    cause = vllm_engine_failure(exc)
                if cause is None:
                    raise
                where = OOM_PHASES["rollout" if phase == "training" else phase]  # in training it serves only rollouts
                checkpoint = self.run_dir.latest_checkpoint()
                kept = (f"the last checkpoint is kept in {checkpoint}; "
                        f"continue with: {resume_command(self.run_dir.path)}"
                        if checkpoint else
                        f"no checkpoint was written yet: {resume_command(self.run_dir.path)} starts it again")
                raise EngineStopped(f"the vLLM engine stopped {where}: {cause}; {kept}") from None

    # ------------------------------------------------------------------ stops
    _PHASES = {"loading": "while loading the model", "starting": "while starting the run",
               "measuring before": "while measuring before training", "priming": "during priming",
               "measuring primed": "while measuring the primed adapter", "training": "during GRPO",
               "measuring start": "while measuring the held-out curve's step 0 (the adapter GRPO starts from)",
               "saving": "while saving the adapter", "measuring after": "while measuring the trained adapter",
               "measuring best": "while measuring the best adapter",
               "exporting": "while exporting", "report": "while writing the report"}
    _WHERE = {"measuring before": "after this batch of answers", "measuring primed": "after this batch of answers",
              "measuring start": "after this batch of answers, before GRPO",
              "measuring after": "after this batch of answers", "measuring best": "after this batch of answers",
              "starting": "once the run's files are written",
              "saving": "once the adapter is saved", "exporting": "once the export is written",
              "report": "once the report is written", "priming": "after this priming step, with a checkpoint",
              "training": "after this step, with a checkpoint"}

    def _enter(self, phase: str) -> None:
        """A safe point between two steps (a signal that came in the last one stops the run here), then `phase`."""
        stops.check()
        self.phase = phase
        RUN_PEAK.enter(phase)  # the run's own peak memory and the phase that set it (summary.json's peak_rss)
        stops.set_where(self._WHERE.get(phase, "at the next safe point"))

    def stopped(self, exc: BaseException) -> Interrupted:
        """The one line for a stop (a StopRequested or a KeyboardInterrupt) in the current phase: what is kept
        and the exact command that goes on."""
        signum = getattr(exc, "signum", None) or stops.received() or signal.SIGINT
        said = f"stopped by {stops.name(signum)} {self._PHASES.get(self.phase, 'during ' + self.phase)}"
        path = self.run_dir.path
        if not self.written:
            return Interrupted(f"{said}: nothing was written; start it again with: {stops.same_command()}", signum)
        if (self.run_dir.read_summary() or {}).get("status") == "complete":
            return Interrupted(f"{said}: the run is complete (adapter {self.run_dir.adapter_dir}, summary.json); "
                               f"write its report with: python -m lowvram_grpo.report {path}", signum)
        return Interrupted(f"{said}; kept: {self._kept()}. Continue with: {resume_command(path)}", signum)

    def _kept(self) -> str:
        parts = []
        checkpoint = self.run_dir.latest_checkpoint()
        primed = self.run_dir.latest_prime_checkpoint()
        if checkpoint is not None:
            parts.append(f"checkpoint {checkpoint} (GRPO step {checkpoint.name.split('-')[-1]} of "
                         f"{self.plan.train.max_steps})")
        elif primed is not None:
            parts.append(f"priming checkpoint {primed} (step {primed.name.split('-')[-1]} of {self.plan.prime.steps})")
        if self.adapter_dir is not None and self.adapter_dir.is_dir():
            parts.append(f"adapter {self.adapter_dir}")
        elif checkpoint is None and self.run_dir.primed_adapter_dir.is_dir():
            parts.append(f"primed adapter {self.run_dir.primed_adapter_dir}")
        if not parts:
            return (f"config.yaml and summary.json in {self.run_dir.path}, "
                    "no checkpoint yet (--resume starts the run again)")
        return ", ".join(parts)

    def _write_settings(self) -> None:
        """config.yaml (what --resume reads back) and plan.txt (what --dry-run prints for these settings)."""
        self.run_dir.write_config(self.user_config)
        self.run_dir.write_plan(run_plan_text(self.user_config, self.resolved))

    def restore_priming(self, checkpoint: Path) -> None:
        """A run resumed in its priming: its settings and the numbers measured before it (priming goes on in
        prime())."""
        self._write_settings()
        self.run_dir.reset_metrics()
        self.run_dir.reset_completions()
        self.run_dir.reset_best()
        self.run_dir.reset_curve_start()  # measured again once the priming ends
        start = self.run_dir.read_summary() or {}
        self.measured["before"] = start.get("before")
        self.texts["before"] = start.get("before_texts", [])

    def restore(self, checkpoint: Path) -> None:
        """A resumed run: the log as it was at `checkpoint`, and the numbers measured before GRPO."""
        self.run_dir.restore_metrics(checkpoint)
        self.run_dir.restore_completions(self.run_dir.read_run_state(checkpoint).get("global_step", 0))
        self.run_dir.restore_best(checkpoint)  # the best as it was at the checkpoint:
                                               # the curve after it is measured again
        self._write_settings()  # with the --set keys the resume changed (config.RESUME_SETTABLE)
        start = self.run_dir.read_summary() or {}
        for stage in ("before", "primed"):
            self.measured[stage] = start.get(stage)
        self.texts["before"] = start.get("before_texts", [])
        self.priming = start.get("priming")
        self.log(f"resuming from {checkpoint}")

    # ------------------------------------------------------------------ measure / prime
    def measure(self, stage: str, adapter: Optional[Path] = None) -> Optional[dict]:
        """The held-out numbers of the base model (`adapter` None) or of a saved adapter, as `stage`. A run
        started from an adapter (lora.init_adapter) measures "before" on that adapter: where GRPO starts."""
        if not self.plan.eval.enabled:
            return None
        self._enter(f"measuring {stage}")
        if stage == "before" and adapter is None and self.plan.model.init_adapter:
            adapter = Path(self.plan.model.init_adapter)
        from lowvram_grpo.evaluate.evaluation import evaluate, protocol, protocol_label  # loads transformers

        what = f"the adapter in {adapter}" if adapter else "the base model"
        self.log(f"measuring {what} on {len(self.eval_rows)} held-out questions ({stage}; "
                 f"{protocol_label(protocol(self.plan.eval))}) ...")
        request = self.handle.load_lora(adapter) if adapter else None
        started = time.perf_counter()
        try:
            with self._failures_reported("evaluation"):
                self.measured[stage], self.texts[stage] = evaluate(self.handle, self.eval_rows, self.plan.eval,
                                                                   lora_request=request)
            if self.eval_rows:  # a held-out answer's seconds on this machine: the curve's measured cost (cadence.py)
                self.answer_seconds = (time.perf_counter() - started) / len(self.eval_rows)
        finally:  # measured, it leaves the model as it was: GRPO trains and checkpoints the trained adapter alone
            if request is not None:
                self.handle.release_lora(request)
        return self.measured[stage]

    def measure_best(self) -> Optional[dict]:
        """best_adapter/ (the held-out curve's best point, validation.py) on the held-out questions, as the `best`
        column; where it is the last step's adapter (the same weights as adapter/) the after column's numbers."""
        facts = self.run_dir.best_facts() if self.resolved.validation_every else None
        if facts is None or not self.plan.eval.enabled:
            return None
        if facts["step"] == self.trainer.state.global_step:
            self.measured["best"], self.texts["best"] = self.measured["after"], self.texts["after"]
            return self.measured["best"]
        start = self._start_stage() if facts["step"] == 0 else None
        if start is not None and self.measured[start]:  # the adapter GRPO started from: its column is measured
            self.log(f"best_adapter/ is step 0, {start_text({START_KEY: self._start_kind()})}: GRPO never beat it on "
                     f"the validation questions; its held-out numbers are the {start} column's")
            self.measured["best"], self.texts["best"] = self.measured[start], self.texts[start]
            return self.measured["best"]
        return self.measure("best", self.run_dir.best_adapter_dir)

    def _start_kind(self) -> str:
        """What GRPO starts from, as the curve's step 0 names it (records.STARTS): 'primed' (primed_adapter/),
        'init_adapter' (lora.init_adapter) or 'base' (a fresh LoRA)."""
        if self.plan.prime.steps > 0:
            return "primed"
        return "init_adapter" if self.plan.model.init_adapter else "base"

    def _start_stage(self) -> str:
        """The held-out column measured on the adapter GRPO starts from: 'primed', else 'before' (the base model, or
        the lora.init_adapter it is measured on)."""
        return "primed" if self._start_kind() == "primed" else "before"

    def _start_adapter(self) -> Optional[Path]:
        """The adapter GRPO starts from as a folder on disk (primed_adapter/, lora.init_adapter), None for a fresh
        LoRA."""
        kind = self._start_kind()
        if kind == "primed":
            return self.run_dir.primed_adapter_dir
        return Path(self.plan.model.init_adapter) if kind == "init_adapter" else None

    def _best_summary(self) -> Optional[dict]:
        """summary.json's `best_adapter`: where it is, its step (the argmax of the curve in metrics.jsonl), its
        validation number, whether it is the last step's adapter; None without a curve."""
        facts = self.run_dir.best_facts() if self.resolved.validation_every else None
        if facts is None:
            return None
        return {"dir": str(self.run_dir.best_adapter_dir), "step": facts["step"], "criterion": facts["criterion"],
                "validation": facts["value"], "same_as_after": facts["step"] == self.trainer.state.global_step,
                "same_as_start": facts["step"] == 0, "start": self._start_kind(),
                "every_steps": self.resolved.validation_every, "validation_questions": len(self.validation_rows)}

    def _best_changes(self) -> dict:
        """The best column's paired changes: {'primed_to_best', 'before_to_best', 'after_to_best'} (evaluation's
        paired_changes, each over the same held-out questions); {} without a best column."""
        from lowvram_grpo.evaluate.evaluation import paired_changes  # loads transformers

        before, primed, after, best = (self.measured[s] for s in ("before", "primed", "after", "best"))
        if not best:
            return {}
        changes = {key.replace("_to_after", "_to_best"): value
                   for key, value in paired_changes(before, best, primed).items()}
        changes.update({"after_to_best": value for value in paired_changes(after, best).values()})
        return changes

    def prime(self, resume_from: Optional[Path] = None) -> Optional[dict]:
        """Supervised priming (priming.py says why: so GRPO's groups have rewards that differ), saved to
        primed_adapter/ and measured; then the start summary, which a resumed run reuses. Priming writes
        prime-checkpoint-N (prime.save_steps, at a stop, at its end); `resume_from`: one to continue from."""
        if self.plan.model.init_adapter and self.plan.prime.steps == 0:
            self.log(f"no priming: the run starts from the adapter in {self.plan.model.init_adapter} "
                     "(--set prime.steps=N primes it further)")
        if self.plan.prime.steps > 0:
            from lowvram_grpo.training.priming import prime  # loads transformers

            self._enter("priming")
            self.run_dir.write_summary(self._start_summary())  # the numbers measured before:
                                                               # a resumed priming reuses them
            with self._failures_reported("priming"):
                self.priming = prime(self.handle, self.train_questions, self.plan.prime, self.log,
                                     checkpoints=self.run_dir if self.run_dir.writer else None, resume_from=resume_from)
            primed_dir = self.handle.save_lora(self.run_dir.primed_adapter_dir) if self.run_dir.writer else None
            if primed_dir is not None:
                self.measure("primed", primed_dir)
        self.run_dir.write_summary(self._start_summary())
        return self.priming

    # ------------------------------------------------------------------ train / save
    def train(self, resume_from: Optional[Path] = None) -> None:
        """GRPO with TRL's trainer (grpo.py); Ctrl-C / SIGTERM stop at a step's end with a checkpoint."""
        from lowvram_grpo.training.grpo import build_trainer, describe_effective  # loads transformers

        self._enter("training")
        validation = None
        if self.resolved.validation_every and self.validation_rows:

            validation = Validation(self.handle, self.validation_rows, self.plan.eval, self.run_dir,
                                    self.resolved.validation_every, self.log, start=self._start_kind(),
                                    start_adapter=self._start_adapter())
            if resume_from is None:
                self._measure_curve_start(validation)
        self.trainer = trainer = build_trainer(self.handle, self.train_rows, self.run_dir, rollouts=self.rollouts,
                                               reward_funcs=self.trainer_rewards, validation=validation,
                                               answer_seconds=self.answer_seconds, log=self.log)
        self.log(describe_effective(trainer.effective_settings))
        if resume_from is not None:
            state = self.run_dir.read_run_state(resume_from)
            trainer.nonfinite_guard.load(state)
            if trainer.completions_log is not None:
                trainer.completions_log.load(state)
        if resume_from is not None and self._trained_to_the_end(trainer, resume_from):
            if validation is not None:  # its last point, if a stop came while it was measured
                with self._failures_reported("evaluation"):
                    validation.catch_up(trainer.state.global_step, self.run_dir.read_metrics(required=False))
            return  # stopped after its last step (saving, measuring, exporting): its checkpoint is the trained adapter
        started = time.time()
        try:
            with trainer.stop_signals.installed(), self._failures_reported("training"), self._rollout_files():
                trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        except RewardError as exc:
            raise TrainingStopped(f"{exc}; {self.run_dir.resume_hint()}") from None
        except RuntimeError as exc:  # NaN/inf weights make sampling fail: say so instead of torch's message
            stopped = trainer.nonfinite_guard.explain(exc, trainer.state)
            if stopped is None:
                raise
            raise stopped from None
        self.train_seconds = time.time() - started
        if self.resolved.cuda and self.resolved.backend == "unsloth":  # what unsloth's decode CUDA graphs did
            # loads transformers
            from lowvram_grpo.core.internals import decode_graph_stats, describe_decode_graphs

            self.decode_graphs = decode_graph_stats(self.handle.model)
            self.log(describe_decode_graphs(self.decode_graphs, self.resolved.decode_graphs))
        trainer.nonfinite_guard.raise_if_stopped(trainer.state, self.run_dir.latest_checkpoint())
        if trainer.adapter_guard.stopped_at is not None and self.run_dir.writer:  # rollouts that ignored the adapter:
            from lowvram_grpo.report.build import write_report  # the report says so too (loads transformers)

            write_report(self.run_dir.path)
        trainer.adapter_guard.raise_if_stopped(trainer.state, self.run_dir.latest_checkpoint())

    def _measure_curve_start(self, validation: Validation) -> None:
        """The held-out curve's step 0 (validation.Validation.start): the model as GRPO starts from it, on the
        validation questions, before the trainer is built. A signal during it stops the run here, before GRPO: no GRPO
        checkpoint exists yet, so --resume measures it again.

        Args:
            validation: the run's curve.
        """
        self._enter("measuring start")
        with self._failures_reported("evaluation"):
            validation.start()
        self._enter("training")  # a safe point: a stop that abandoned the measurement ends the run here

    def _rollout_files(self):
        """unsloth's vLLM rollouts write a LoRA folder into the working directory: moved into the run's folder."""
        if self.resolved.generation != "unsloth_vllm" or not self.run_dir.writer:
            return contextlib.nullcontext()

        return rollout_files_moved_to(self.run_dir.path)

    def _trained_to_the_end(self, trainer, checkpoint: Path) -> bool:
        """A checkpoint at train.max_steps or past it: its adapter weights and trainer state are restored and no
        step runs. transformers' `train(resume_from_checkpoint=...)` would run one more step first: it skips the
        trained batches and checks `max_steps` only at the end of the next step."""
        from transformers import TrainerState

        from lowvram_grpo.training.trl_compat import set_trainer_state  # loads transformers and TRL

        state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        if state.global_step < self.plan.train.max_steps:
            return False
        load_adapter_weights(self.handle.model, checkpoint, base_model=self.handle.base_model)
        set_trainer_state(trainer, state)
        self.log(f"{checkpoint.name} is GRPO step {state.global_step} of train.max_steps={self.plan.train.max_steps}: "
                 "no step left to train, going on from its adapter")
        return True

    def save(self) -> Path:
        """adapter/ (PEFT format + tokenizer, atomically); a run stopped by a signal then ends with --resume's hint."""
        self.phase = "saving"  # no safe point before it: a signal in GRPO's last step is answered after the save
        RUN_PEAK.enter("saving")
        stops.set_where(self._WHERE["saving"])
        if self.run_dir.writer:
            self.adapter_dir = self.handle.save_lora(self.run_dir.adapter_dir)
        self.trainer.accelerator.wait_for_everyone()
        self.adapter_dir = self.run_dir.adapter_dir
        self.trainer.stop_signals.raise_if_stopped(self.trainer.state, self.run_dir.path, self.adapter_dir)
        return self.adapter_dir

    # ------------------------------------------------------------------ export / finish
    def export(self, kind: Optional[str] = None) -> Optional[Path]:
        kind = kind or self.export_kind
        if not kind or not self.run_dir.writer:
            return None
        check_export_fits_host(kind, self.plan.model.facts, self.resolved.backend)  # the notebook's
                                                                                   # export cell asks here
        self._enter("exporting")
        written = export_model(self.handle, self.adapter_dir, self.run_dir.export_dir(kind), kind)
        self.log(f"exported ({kind}): {written}")
        return written

    def finish(self) -> RunResult:
        """summary.json (status complete, with the paired changes computed once), the before/after table, what GRPO
        changed (one held-out question it turned right, one it turned wrong, with the counts), report.md and the
        plots, and the model card (README.md, over TRL's)."""
        from lowvram_grpo.evaluate.evaluation import format_table, paired_changes  # loads transformers

        stops.check()  # a signal in the last step before: the run is not marked complete
        trainer, measured = self.trainer, self.measured
        summary = {
            "status": "complete",
            "preset": self.plan.preset,
            "backend": self.resolved.backend,
            "device": self.resolved.device,
            "model": self.plan.model.name,
            "init_adapter": self.plan.model.init_adapter,
            "steps": trainer.state.global_step,
            "train_seconds": round(self.train_seconds, 2),
            "total_seconds": round(time.time() - self.started, 2),
            **measured,
            "priming": self.priming,
            "resolved": self.resolved.summary(),
            "host_allocator_active": allocator.active(),
            "peak_rss": RUN_PEAK.facts(),  # this process's ru_maxrss and the phase that set it (peak_memory.py)
            "step_time": trainer.cadence.facts() if getattr(trainer, "cadence", None) is not None else None,
            "grpo_settings": trainer.effective_settings,
            **({"decode_graph_stats": self.decode_graphs}
               if self.resolved.cuda and self.resolved.backend == "unsloth" else {}),
            "skipped_nonfinite": trainer.nonfinite_guard.skipped,
            "reward_failures": {f.__name__: f.failures for f in trainer.reward_funcs if getattr(f, "failures", 0)},
            "samples": [
                {"question": prompt_text(row["prompt"]), "answer": row.get("answer"), "base": b, "trained": a}
                for row, b, a in list(zip(self.eval_rows, self.texts["before"], self.texts["after"]))[:2]
            ],
            "paired_changes": paired_changes(measured["before"], measured["after"], measured["primed"]),
            "best_adapter": self._best_summary(),
            "paired_changes_best": self._best_changes(),
            "what_changed": self._what_changed(),
        }
        result = RunResult(output_dir=self.run_dir.path, adapter_dir=self.adapter_dir, summary=summary,
                           handle=self.handle)
        if not self.run_dir.writer:
            return result
        self.run_dir.write_summary(summary)
        if measured["before"] and measured["after"]:
            self.log("\n" + format_table(measured["before"], measured["after"], measured["primed"],
                                         summary["paired_changes"]))
            if summary["what_changed"]:
                from lowvram_grpo.report.build import changed_lines  # loads transformers

                self.log("\n" + "\n".join(changed_lines(summary["what_changed"])))
            else:  # no per-question verdicts (data without gold answers): the first questions
                for sample in summary["samples"]:
                    self.log(f"\nQ: {sample['question']}  (gold: {sample['answer']})")
                    self.log(f"--- base ---\n{sample['base'].strip()}\n--- trained ---\n{sample['trained'].strip()}")
        from lowvram_grpo.report.build import write_report  # loads transformers

        card = write_card(self.run_dir.path, summary)  # README.md, over TRL's; before the report, which a stop may cut
        self._enter("report")

        def record_peak() -> None:  # the plots may raise the peak: summary.json says so before report.md
            if RUN_PEAK.facts() != summary["peak_rss"]:
                summary["peak_rss"] = RUN_PEAK.facts()
                self.run_dir.write_summary(summary)

        report = write_report(self.run_dir.path, after_plots=record_peak)  # report.md + plots: metrics, summary.json
        peak = summary["peak_rss"]  # as recorded
        self.log(f"\nadapter: {self.adapter_dir}\nsummary: {self.run_dir.file('summary.json')}\nreport:  {report}"
                 f"\ncard:    {card}\nmemory:  {describe(peak['gib'], peak['phase'])}, this process's ru_maxrss "
                 "(summary.json's peak_rss)")
        self.release()
        return result

    def _what_changed(self) -> Optional[dict]:
        """The held-out questions GRPO turned right / wrong, counted, one example of each (report.what_changed)."""
        from lowvram_grpo.report.build import what_changed  # loads transformers

        return what_changed([prompt_text(row["prompt"]) for row in self.eval_rows],
                            [row.get("answer") for row in self.eval_rows], self.texts, self.measured)

    def release(self) -> None:
        """Let go of the output dir's lock (taken in __init__; the process ending lets go of it too)."""
        if self.locked:
            self.locked = False
            self.run_dir.unlock()


def _num_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(config: RunConfig, output_dir, backend: str = "auto", log=print, handle=None,
        resume_from: Optional[Path] = None, export: Optional[str] = None, existing: str = "refuse",
        prime_from: Optional[Path] = None) -> RunResult:
    """A whole run: checks, load, measure before, prime, GRPO, measure after, save, report.

    Args:
        config: the run's settings (settings.config.RunConfig), one section each, every key in docs/guide.md:
            `model` (checkpoint, max_seq_length, generation), `lora` (r, alpha, targets, init_adapter), `train`
            (GRPO: steps, group size, lengths, learning rate, optimizer, checkpoints, the correction), `data`
            (dataset, columns, system prompt, held-out split), `rewards` (names, weights, module), `tools` and
            `environment` (the tool loop), `prime` (the supervised start), `eval` (held-out measure and curve),
            `log` (completions.jsonl, trackers), `memory` (4-bit, vLLM share, host allocator), `decode` (our
            decode loop). The pipeline builds the plan from it once (plans.run_plan) and its steps read the plan.
        output_dir: where the run's files go (report/run_dir.py is the one writer).
        backend: 'auto', 'unsloth' or 'hf' (resolve decides 'auto' from the machine).
        log: where progress lines go (print).
        handle: a model already loaded for this config (the notebook's), else loaded here.
        resume_from: a checkpoint in `output_dir` to continue from (see `resume`).
        export: 'merged16' or 'gguf' after training, or None.
        existing: a run already in `output_dir` is refused ('refuse'), replaced ('overwrite') or continued ('resume').
        prime_from: a prime-checkpoint-N in `output_dir` to continue the priming from (with `resume_from` None).

    Returns:
        RunResult: the summary (summary.json's dict), the adapter's folder and the handle.

    A vLLM engine started for the run ends when the run raises (an error, a stop, Ctrl-C); after a normal return it
    stays with the handle (the notebook generates with it) and ends at exit. SIGINT/SIGTERM/SIGHUP stop it at the
    next safe point (stops.py) with one `Interrupted` line."""

    with stops.handled():
        return closes_engines_on_error(_run)(config, output_dir, backend, log, handle, resume_from, export, existing,
                                             prime_from)


def _run(config, output_dir, backend, log, handle, resume_from, export, existing="refuse",
         prime_from=None) -> RunResult:
    grpo = GRPORun(config, output_dir, backend, log, export=export, existing=existing)
    try:
        return _steps(grpo, handle, resume_from, prime_from)
    except (StopRequested, KeyboardInterrupt) as exc:
        raise grpo.stopped(exc) from None
    except LowvramError:  # GRPO's own stop line (guards.StopOnSignal), or an error that says how to go on
        raise
    except Exception:
        if stops.received() is None:
            raise
        raise grpo.stopped(StopRequested(stops.received())) from None  # a library turned the stop into its own error
    finally:
        grpo.release()


def _steps(grpo: "GRPORun", handle, resume_from, prime_from=None) -> RunResult:
    grpo.load(handle)  # a signal here stops at once: nothing is written yet
    with stops.deferred():  # from here on, a signal stops the run at the next safe point
        if resume_from is None:
            if prime_from is None:
                grpo.start()
                grpo.measure("before")
            else:
                grpo.restore_priming(prime_from)
            grpo.prime(prime_from)
        else:
            grpo.restore(resume_from)
        grpo.train(resume_from)
        grpo.save()
        grpo.measure("after", grpo.adapter_dir)
        grpo.measure_best()
        grpo.export()
        return grpo.finish()


def resume(output_dir, backend: str = "auto", log=print, overrides: Optional[list[str]] = None,
           export: Optional[str] = None) -> RunResult:
    """Continue the run in `output_dir` (`--resume`) from its newest complete checkpoint to its configured end,
    on the backend it started on (their optimizers' saved states differ). `overrides`: the --set keys a
    resume may change (config.RESUME_SETTABLE); `export`: merged16/gguf, else the export the run started with."""
    run_dir = RunDir(output_dir)
    config = run_dir.resumable_config(overrides or [])
    started = run_dir.started_backend()
    if backend == "auto":
        backend = started
    elif started != "auto" and backend != started:
        raise ConfigError(f"--resume {run_dir}: the run started on the {started} backend; "
                          f"resume it with --backend {started} (or leave --backend out)")
    run_dir.lock()  # before anything is touched: a second --resume (or a run still going) is refused here
    try:
        run_dir.remove_leftovers()
        checkpoint = run_dir.latest_checkpoint()
        primed = run_dir.latest_prime_checkpoint() if checkpoint is None else None
        if primed is not None:
            log(f"no GRPO checkpoint in {run_dir} yet: continuing its priming from {primed}")
        elif checkpoint is None:
            log(f"no complete checkpoint in {run_dir} yet: running it again from the start")
        return run(config, run_dir.path, backend, log, resume_from=checkpoint, existing="resume",
                   export=export or run_dir.started_export(), prime_from=primed)
    finally:
        run_dir.unlock()


def default_output_dir(preset: str) -> Path:
    return Path("outputs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def train(preset: str = "tiny", overrides: Optional[list[str]] = None, output_dir: Optional[str] = None,
          backend: str = "auto", overwrite: bool = False) -> RunResult:
    """Python entry point: `lowvram_grpo.train("tiny", ["train.max_steps=3"], "runs/x")`.

    Args:
        preset: a preset name (presets/*.yaml) or a YAML file.
        overrides: `SECTION.KEY=VALUE` settings over the preset (the sections: `run`'s Args).
        output_dir: where the run writes (default outputs/PRESET-TIME); a run already there is refused unless
            `overwrite`.
        backend: 'auto', 'unsloth' or 'hf'.
        overwrite: replace a run already in `output_dir`.

    Returns:
        RunResult, as `run` returns it."""

    config = load_config(preset, overrides or [])
    return run(config, Path(output_dir) if output_dir else default_output_dir(config.preset), backend,
               existing="overwrite" if overwrite else "refuse")
