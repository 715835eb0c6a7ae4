"""GRPO training through TRL's `GRPOTrainer`: the algorithm stays in TRL.

This module hands TRL the `GRPOConfig` built from the run's plan (settings/plans.py), the PEFT model, the reward
functions (with their weights; `correctness` also logs the share of all-right and all-wrong groups) and the prompt rows,
and adds three callbacks: a progress bar (step, time left, the reward and its moving average, the share
of groups with signal, the KL when beta > 0; not TRL's loss, ~0 by construction), a `metrics.jsonl`
writer (one JSON object per logged step) and the training-signal warnings (learning_signals.py: truncated
completions, groups with all-equal rewards and which way, a flat reward), plus the guards
(guards.py: NaN/inf steps skipped, Ctrl-C / SIGTERM at a step boundary). Checkpoints are written
atomically with our run state through RunDir, and resuming restores the trained adapter; the private
Trainer hooks this needs live in trl_compat.py. Under `accelerate launch` (several processes, hf
backend) TRL runs data-parallel GRPO; only the main process writes files.

Choices, as in the Unsloth notebook: one prompt's group of `num_generations` completions per
micro-step (per_device_train_batch_size defaults to num_generations), advantages normalised within
each group (TRL's default), a KL penalty `beta` against the adapter-free base (no second model in
memory: PEFT disables the adapters for the reference pass), paged 8-bit AdamW.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import math
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from trl import GRPOConfig

from lowvram_grpo.report.peak_memory import RUN_PEAK
from lowvram_grpo.report.run_dir import RunDir
from lowvram_grpo.core import host_memory
from lowvram_grpo.settings.plans import grpo_config_kwargs
from lowvram_grpo.task.tools import environment_methods
from lowvram_grpo.task.user_code import of as user_code_of
from lowvram_grpo.training.completions import CompletionsLog, markdown_rows, with_completion_facts
from lowvram_grpo.training.adapter_check import AdapterGuard, progress_field
from lowvram_grpo.training.cadence import MeasuredCadence
from lowvram_grpo.training.guards import NonFiniteGuard, StopOnSignal
from lowvram_grpo.report.learning_signals import (
    ALL_RIGHT_KEY,
    ALL_WRONG_KEY,
    SAMPLER_GAP_KEY,
    SAMPLER_GAP_THRESHOLD,
    SMOOTHING,
    ZERO_STD_KEY,
    SignalMonitor,
)
from lowvram_grpo.training.tool_metrics import TRANSCRIPT_KEY, with_tool_use
from lowvram_grpo.training.trl_compat import (
    DynamicSampling,
    ModelSampler,
    RatioFromLoss,
    SampledTokenScores,
    SharedPrompt,
    TrainerHooks,
    grpo_trainer_base,
    install_logprob_fallback,
    is_unsloth_trainer,
    sample_with,
    trainer_callbacks,
    trainer_name,
)
from lowvram_grpo.training.validation import due, start_to_trackers


def grpo_args(resolved, output_dir: Path) -> GRPOConfig:
    return grpo_config(**grpo_config_kwargs(resolved, output_dir))


def grpo_config(**asked) -> GRPOConfig:
    """GRPOConfig(**asked) with bf16 as asked. unsloth's CPU fallback (unsloth_zoo/cpu/trainer.py, installed at
    `import unsloth` on a machine without a GPU) turns bf16=True off in TrainingArguments.__post_init__ on a CPU
    without native bf16; UnslothGRPOTrainer then sees neither bf16 nor fp16 for a bfloat16 model and wraps it in fp16
    autocast. resolve.for_unsloth_trainer asked bf16 for exactly that model (model.dtype=bfloat16 chosen by the
    user): it is put back once __post_init__ has run."""
    args = GRPOConfig(**asked)
    if asked.get("bf16") and not args.bf16:
        args.bf16 = True
    return args


# The GRPO settings a trainer actually uses, read back from the built trainer: unsloth's patched
# GRPOTrainer/GRPOConfig changes several of TRL's defaults (loss type, beta, importance-sampling
# correction, vLLM mode, batch rounding, mixed precision), and TRL derives others (generation batch,
# steps per generation). See docs/unsloth_grpo_changes.md.
EFFECTIVE_KEYS = (
    "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "importance_sampling_level", "num_iterations",
    "mask_truncated_completions", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
    "generation_batch_size", "steps_per_generation", "max_completion_length", "temperature", "top_p", "top_k",
    "use_vllm", "vllm_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "bf16", "fp16", "optim", "learning_rate",
    "lr_scheduler_type", "max_grad_norm", "gradient_checkpointing", "gradient_checkpointing_kwargs",
    "vllm_enable_sleep_mode", "torch_empty_cache_steps", "reward_weights", "top_entropy_quantile",
)


def _plain(value):
    if isinstance(value, enum.Enum):  # optim, lr_scheduler_type (str enums)
        return _plain(value.value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if hasattr(value, "tolist"):  # a tensor (reward_weights)
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def describe_effective(effective: dict) -> str:
    """One line for the run log: the GRPO settings that shape the loss, and what the trainer changed."""
    s = effective["settings"]
    line = (f"GRPO as the trainer runs it: trainer={effective['trainer']} loss_type={s['loss_type']} "
            f"beta={s['beta']} epsilon={s['epsilon']} epsilon_high={s['epsilon_high']} "
            f"importance_sampling_level={s['importance_sampling_level']} "
            f"mask_truncated_completions={s['mask_truncated_completions']} "
            f"top_entropy_quantile={s['top_entropy_quantile']} "
            "dynamic_sampling="
            f"{_dynamic_sampling_label(s.get('dynamic_sampling_max_draws', 0), s.get('dynamic_sampling_reward'))} "
            f"scale_rewards={s['scale_rewards']} num_generations={s['num_generations']} "
            f"generation_batch_size={s['generation_batch_size']} use_vllm={s['use_vllm']} bf16={s['bf16']} "
            f"fp16={s['fp16']}")
    if s["use_vllm"] or s["vllm_importance_sampling_correction"]:  # resolve decides it for every vLLM path
        line += (f" vllm_importance_sampling_correction={s['vllm_importance_sampling_correction']}"
                 f" ({s['vllm_importance_sampling_mode']}"
                 f"{', trainer log-probs from the loss' if s.get('is_ratio_from_loss') else ''})")
    if s.get("shared_prompt"):
        line += " shared_prompt=on (the group's prompt once in the loss)"
    if effective["changed"]:
        line += "; changed from the config by the trainer: " + ", ".join(
            f"{k} {a!r} -> {u!r}" for k, (a, u) in effective["changed"].items())
    return line


def _dynamic_sampling_label(max_draws: int, reward=None) -> str:
    if not max_draws:
        return "off"
    return f"on(max_draws={max_draws}, by {reward})" if reward else f"on(max_draws={max_draws})"


def effective_grpo_settings(trainer, asked: dict) -> dict:
    """{'trainer': the GRPO trainer class that runs, 'settings': what the built trainer will use, 'changed':
    {key: [asked, used]}} for EFFECTIVE_KEYS. Read from `trainer.args` (and the trainer's own attribute of the
    same name where it has one, as TRL and unsloth keep the live value there)."""
    used = {key: _plain(getattr(trainer, key, getattr(trainer.args, key, None))) for key in EFFECTIVE_KEYS}
    used["dynamic_sampling_max_draws"] = getattr(trainer, "dynamic_sampling_draws", 0)  # ours
                                                                                        # (trl_compat.DynamicSampling)
    used["dynamic_sampling_reward"] = getattr(trainer, "dynamic_sampling_reward", None)
    used["is_ratio_from_loss"] = isinstance(trainer, RatioFromLoss) and trainer.is_ratio_from_loss  # ours
    used["shared_prompt"] = isinstance(trainer, SharedPrompt) and trainer.shared_prompt  # ours
    if asked.get("epsilon_high") is None and "epsilon" in asked:  # null asks for epsilon's value (as TRL reads it)
        asked = {**asked, "epsilon_high": asked["epsilon"]}
    changed = {key: [_plain(asked[key]), used[key]] for key in EFFECTIVE_KEYS
               if key in asked and _plain(asked[key]) != used[key]}
    return {"trainer": trainer_name(trainer), "settings": used, "changed": changed}



class ReleaseHostMemory(TrainerCallback):
    """host_memory.release() after every optimizer step: the step's freed memory back to the OS."""
    def on_step_end(self, args, state, control, **kwargs):
        host_memory.release()


class MetricsWriter(TrainerCallback):
    """Appends each logged step to metrics.jsonl (through RunDir): `step`, `reward`, `loss` and every other TRL
    metric."""
    def __init__(self, run_dir: RunDir, tool_use=None):
        self.run_dir = run_dir
        self.tool_use = tool_use  # tool_metrics.ToolUse when the run has tools: a transcript at checkpoint steps

    def on_log(self, args, state, control, logs=None, **kwargs):
        row = metric_row(state.global_step, logs)
        if row is not None and state.is_world_process_zero:
            step = state.global_step
            checkpoint = bool(args.save_steps) and step % int(args.save_steps) == 0 or step == state.max_steps
            if self.tool_use is not None and checkpoint and self.tool_use.transcript() is not None:

                row[TRANSCRIPT_KEY] = self.tool_use.transcript()
            self.run_dir.append_metrics(row)


def metric_row(step: int, logs) -> dict | None:
    """One training step's numbers as metrics.jsonl stores them (None for logs that are not a training step)."""
    if not logs or "reward" not in logs:  # the end-of-training summary has no reward
        return None
    row = {"step": step}
    for key, value in logs.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = value if math.isfinite(value) else None
    return row


class CompletionsWriter(TrainerCallback):
    """completions.jsonl (completions.py: its rows and size policy) at each logged GRPO step, from TRL's log of the
    step's rollouts (trl_compat.completion_log); with TensorBoard, the first group of a written step as its text too."""

    def __init__(self, policy, trainer):
        self.policy, self.trainer = policy, trainer

    def on_log(self, args, state, control, logs=None, **kwargs):
        if (not logs or "reward" not in logs or not state.is_world_process_zero
                or not self.policy.due(state.global_step)):
            return
        from lowvram_grpo.training.trl_compat import completion_log  # loads transformers

        written = self.policy.write(state.global_step, completion_log(self.trainer))
        writer = next((getattr(cb, "tb_writer", None) for cb in trainer_callbacks(self.trainer)
                       if getattr(cb, "tb_writer", None) is not None), None)
        if written and writer is not None:

            writer.add_text("completions", markdown_rows(self.policy.run_dir.read_completions(), state.global_step),
                            state.global_step)


class ValidationCurve(TrainerCallback):
    """The held-out curve (validation.py): measured at the end of the steps it is due (the step is then logged), its
    numbers added to that step's logs before any tracker or metrics.jsonl sees them (this callback runs first); on
    resume the checkpoint's step is measured first if its point is missing."""

    def __init__(self, validation, run_dir: RunDir):
        self.validation, self.run_dir, self.due, self.pending = validation, run_dir, due, None

    def on_train_begin(self, args, state, control, **kwargs):
        rows = self.run_dir.read_metrics(required=False)
        if state.global_step > 0:
            self.validation.catch_up(state.global_step, rows)
        else:
            self.validation.restore([])

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is not None:  # its step logged no training row: into metrics.jsonl alone
            self.run_dir.add_to_metrics_row(*self.pending)
            self.pending = None
        if self.due(state.global_step, self.validation.every, state.max_steps):
            numbers = self.validation.measure(state.global_step)
            if numbers is not None:
                self.pending = (state.global_step, numbers)
                control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending is not None and logs is not None and "reward" in logs and self.pending[0] == state.global_step:
            logs.update(self.pending[1])
            self.pending = None


class SignalWarnings(TrainerCallback):
    """Prints a training-signal warning (learning_signals.py) the first time its pattern shows in the logged metrics."""
    def __init__(self, max_completion_length: int):

        self.monitor = SignalMonitor(max_completion_length)

    def on_log(self, args, state, control, logs=None, **kwargs):
        row = metric_row(state.global_step, logs)
        if row is None:
            return

        for signal in self.monitor.add(row):
            tqdm.write(f"warning: {signal}", file=sys.stderr)  # above the progress bar, not through it


class ProgressBar(TrainerCallback):
    """A tqdm bar with what means something in GRPO: step/total and time left, the step's mean reward and
    its moving average (signals.SMOOTHING logged steps: at a few prompts per step the raw reward is noise),
    the share of groups whose rewards differed (the only ones with a gradient), and the KL to the base
    when train.beta > 0. Not TRL's loss: with group-normalised advantages it is ~0 by construction.

    Two log lines beside it: on a CUDA device, before step 1, that step 1 includes compiling (compile_note); and
    once a few steps are done (projection_due), the projected finish on this machine (projection_line), from the
    steps after the first (the first carries the warm-up, on a GPU the compiling)."""

    def __init__(self, total: int, initial: int = 0, beta: float = 0.0, cadence=None):
        self.total, self.initial, self.beta, self.bar = total, initial, beta, None
        self.cadence = cadence  # cadence.MeasuredCadence: the step time and checkpoint cadence shown (None: not shown)
        self.rewards: collections.deque = collections.deque(maxlen=SMOOTHING)
        self.first_step = self.began = self.first_done = None  # this process's first step, its start, its end
        self.projected = False

    def on_train_begin(self, args, state, control, **kwargs):

        initial = max(self.initial, state.global_step)  # a resumed run starts at its checkpoint's step
        self.bar = tqdm(total=self.total, initial=initial, desc="GRPO", unit="step", dynamic_ncols=True)
        self.first_step, self.began = initial, time.monotonic()
        device = getattr(getattr(args, "device", None), "type", None)
        note = compile_note(device, is_unsloth_trainer(grpo_trainer_base()), initial + 1)
        if note:
            tqdm.write(note)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
        if self.began is None or self.projected:
            return
        now, done = time.monotonic(), state.global_step - self.first_step
        if done == 1:
            self.first_done = now
        if projection_due(done, self.total - self.first_step):
            self.projected = True
            after_first = now - self.first_done if self.first_done is not None else None
            tqdm.write(projection_line(state.global_step, self.total, done, now - self.began, after_first, time.time()))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "reward" in logs:
            fields = progress_fields(logs, self.rewards, self.beta)
            fields.update(self.cadence.fields() if self.cadence is not None else {})
            fields["peak"] = RUN_PEAK.text().removeprefix("peak ")  # the run's own peak memory: the line's last words
            self.bar.set_postfix(fields, refresh=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


PROJECT_AFTER = 3  # steps done (this process) before the projected finish is logged, or 10% of the steps if more


def projection_due(done: int, steps: int) -> bool:
    """Log the projection now? After max(PROJECT_AFTER, 10% of this process's `steps`) steps, while steps remain."""
    return done >= max(PROJECT_AFTER, math.ceil(steps / 10)) and done < steps


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def projection_line(step: int, total: int, done: int, elapsed: float, after_first: float | None, now: float) -> str:
    """'GRPO: 3 of 48 steps in 74 s, ~24.6 s/step: projected to end at 17:42 (~19 min more)'. `done` steps ran
    in this process in `elapsed` s (fewer than `step` on a resumed run); the time per step is from the steps after
    the first (`after_first`: seconds since the first ended) when there are any; `now`: the wall clock."""

    per_step = after_first / (done - 1) if after_first is not None and done >= 2 else elapsed / done
    left = (total - step) * per_step
    end = time.localtime(now + left)
    clock = time.strftime("%H:%M" if end.tm_yday == time.localtime(now).tm_yday else "%a %H:%M", end)
    ran = f"{step} of {total} steps in {elapsed:.0f} s" if done == step else \
        f"step {step} of {total}, {done} steps in {elapsed:.0f} s since the resume"
    basis = " after the first" if done >= 2 and after_first is not None else ""
    return (f"GRPO: {ran}, ~{per_step:.1f} s/step{basis}: projected to end at {clock} "
            f"(~{_duration(left)} more) on this machine")


def compile_note(device: str | None, unsloth: bool, step: int = 1) -> str | None:
    """On a CUDA device, the log line that says GRPO's first step compiles kernels (Triton: unsloth's kernels and
    compiled loss on the unsloth backend, TRL's fused log-prob head and torch inductor otherwise), so it takes
    longer than the steps after it; None elsewhere (a CPU compiles nothing)."""
    if device != "cuda":
        return None
    what = "unsloth's Triton kernels and its compiled GRPO loss" if unsloth else "TRL's Triton kernels"
    return (f"GRPO step {step} includes compiling {what} on first use: it takes longer than the steps after it "
            f"(the projected finish leaves it out)")


def progress_fields(logs: dict, recent: "collections.deque", beta: float) -> dict:
    """The bar's fields for one logged step; `recent` keeps the last rewards for the moving average."""
    reward = logs["reward"]
    if isinstance(reward, (int, float)) and math.isfinite(reward):
        recent.append(reward)
    fields = {"reward": f"{reward:.3f}"}
    if recent:
        fields[f"avg{recent.maxlen}"] = f"{sum(recent) / len(recent):.3f}"
    if isinstance(logs.get(ZERO_STD_KEY), (int, float)):
        fields["signal"] = f"{1 - logs[ZERO_STD_KEY]:.0%} of groups"
    if beta > 0 and isinstance(logs.get("kl"), (int, float)):
        fields["kl"] = f"{logs['kl']:.4f}"
    gap = logs.get(SAMPLER_GAP_KEY)
    if isinstance(gap, (int, float)) and gap > SAMPLER_GAP_THRESHOLD:  # the sampler is off the trained policy
        fields["sampler gap"] = f"{gap:.3f} nats/token > {SAMPLER_GAP_THRESHOLD}"
    if progress_field(logs):  # the sampled tokens scored closer to the base than to the adapter (adapter_check.py)
        fields["adapter"] = progress_field(logs)
    return fields


class GroupOutcomes:
    """The correctness reward, also logging per GRPO step the share of groups whose completions were all
    right (`groups/all_right`) and all wrong (`groups/all_wrong`) through TRL's `log_metric` hook: such
    groups carry no signal, and which of the two they are says what to change (signals.no_signal). Groups
    are consecutive runs of num_generations completions, as TRL orders them (on several processes a group
    may be split, and the shares are approximate). Otherwise the function TRL was handed, name and all."""

    def __init__(self, fn, group_size: int):
        self.fn, self.group_size = fn, group_size
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__

    @property
    def failures(self) -> int:
        return getattr(self.fn, "failures", 0)

    def __call__(self, prompts, completions, **kwargs):
        scores = self.fn(prompts=prompts, completions=completions, **kwargs)
        log = kwargs.get("log_metric")
        g = self.group_size
        if log is not None and scores and len(scores) % g == 0:
            groups = [scores[i:i + g] for i in range(0, len(scores), g)]
            log(ALL_RIGHT_KEY, sum(1 for group in groups if all(s > 0 for s in group)) / len(groups))
            log(ALL_WRONG_KEY, sum(1 for group in groups if all(s <= 0 for s in group)) / len(groups))
        return scores


def with_group_outcomes(reward_funcs: list, group_size: int) -> list:
    """`reward_funcs` with the `correctness` reward wrapped by GroupOutcomes (the others as they are)."""
    return [GroupOutcomes(fn, group_size) if fn.__name__ == "correctness" else fn for fn in reward_funcs]


@dataclasses.dataclass(frozen=True)
class RunExtras:
    """What a RunTrainer takes beside TRL's GRPOTrainer arguments (build_trainer fills it from the run's settings).

    Args:
        run_dir: where checkpoints, metrics.jsonl and completions.jsonl go.
        tool_functions: the run's tools and environment methods, with their call / failure / timeout counts.
        tool_use: tool_metrics.ToolUse when the run has tools (a transcript at checkpoint steps), else None.
        max_nonfinite_steps, learning_rate: guards.NonFiniteGuard's.
        keep_checkpoints: how many checkpoints stay on disk.
        data_per_step: {"prompts": n, "completions": n} drawn per optimizer step.
        max_steps, beta, max_completion_length: the progress bar's and the signal warnings'.
        completions: completions.CompletionsLog's keyword arguments after run_dir, its `weights` a list in
            rewards.names order (paired with the trainer's reward functions), or None: no completions.jsonl.
        validation: a validation.Validation measuring the held-out curve, or None.
        dynamic_sampling_draws: trl_compat.DynamicSampling's (0 = off); dynamic_sampling_reward / _column: judge by
            that reward function's column alone (None: the weighted sum).
        is_ratio_from_loss: trl_compat.RatioFromLoss's (resolve.choose_is_logprobs): the correction's trainer log-probs
            from the loss's forward instead of TRL's extra no-grad forward.
        shared_prompt: trl_compat.SharedPrompt's (plan.train.shared_prompt, decided by resolve): the group's prompt
            computed once in the loss's forward and backward.
        adapter_check_every: trl_compat.SampledTokenScores' (plan.train.adapter_check_every): score a step's sampled
            tokens under the adapter and the base every this many GRPO steps (0 = off: no guard either).
        adapter_guard_steps: adapter_check.AdapterGuard's stop_after (0: it warns, never stops).
        asked: the GRPOConfig keyword arguments build_trainer asked for (effective_grpo_settings compares them).
        environment: variables set while `train` runs and restored after (resolve.Resolved.trainer_environment of the
            settings the model was loaded with: unsloth's IS mode only where its vLLM engine started)."""

    run_dir: RunDir
    tool_functions: list
    tool_use: object
    max_nonfinite_steps: int
    learning_rate: float
    keep_checkpoints: int
    data_per_step: dict
    max_steps: int
    beta: float
    max_completion_length: int
    completions: dict | None = None
    validation: object = None
    dynamic_sampling_draws: int = 0
    dynamic_sampling_reward: str | None = None
    dynamic_sampling_column: int | None = None
    is_ratio_from_loss: bool = False
    shared_prompt: bool = False
    adapter_check_every: int = 0
    adapter_guard_steps: int = 0
    asked: dict = dataclasses.field(default_factory=dict)
    environment: dict = dataclasses.field(default_factory=dict)
    cadence: object = None  # cadence.MeasuredCadence: the step time measured, the checkpoint cadence and curve on it


@contextlib.contextmanager
def environment_set(changes: dict):
    """`changes` in os.environ for the block; each variable's earlier value (or its absence) restored after, so a
    notebook that trains again, or without vLLM, does not keep the variable."""
    old = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RunTrainer(SampledTokenScores, DynamicSampling, TrainerHooks):
    """Mixed over the GRPOTrainer class in use (trainer_class): our checkpoints (run_dir.RunDir.save_checkpoint:
    atomic, with our run state), the NaN guard's view of the gradient norm, and the trained adapter restored on
    resume (trl_compat's hooks). Built with `extras` (RunExtras) beside GRPOTrainer's own arguments; everything it
    keeps and every callback it runs is set here, nothing on the trainer after it is built (but trl_compat's)."""

    nonfinite_guard: NonFiniteGuard
    stop_signals: StopOnSignal
    run_dir: RunDir
    keep_checkpoints: int = 2
    data_per_step: dict
    completions_log = None  # completions.CompletionsLog when log.completions_every > 0

    def __init__(self, *args, extras: RunExtras, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_functions = extras.tool_functions  # their call / failure / timeout counts
        for callback in (PrinterCallback, ProgressCallback):
            self.remove_callback(callback)
        self.run_dir = extras.run_dir
        self.nonfinite_guard = NonFiniteGuard(extras.max_nonfinite_steps, extras.learning_rate)
        self.stop_signals = StopOnSignal()
        self.keep_checkpoints = extras.keep_checkpoints
        self.data_per_step = extras.data_per_step
        self.run_environment = dict(extras.environment)
        self.checkpoint_saver = self.save_checkpoint_with
        self.grad_norm_observer = self.nonfinite_guard.note_grad_norm
        self.add_callback(self.nonfinite_guard)  # before MetricsWriter: it adds skipped_nonfinite to the logs
        self.add_callback(self.stop_signals)
        self.adapter_guard = AdapterGuard(extras.adapter_guard_steps)  # before the bar and MetricsWriter: its flag
        self.adapter_check_every = extras.adapter_check_every  # joins the step's logs (adapter_check.py)
        if extras.adapter_check_every:
            self.adapter_score_observer = self.adapter_guard.note
            self.add_callback(self.adapter_guard)
        if self.is_world_process_zero():
            self.add_callback(ProgressBar(extras.max_steps, beta=extras.beta, cadence=extras.cadence))
            self.add_callback(SignalWarnings(extras.max_completion_length))
        self.add_callback(MetricsWriter(self.run_dir, extras.tool_use))
        if extras.completions is not None and self.is_world_process_zero():
            settings = dict(extras.completions)
            settings["weights"] = dict(zip(self.reward_func_names, settings["weights"]))
            self.completions_log = CompletionsLog(self.run_dir, **settings)
            self.add_callback(CompletionsWriter(self.completions_log, self))
        self.validation = extras.validation
        if extras.validation is not None:  # first: its numbers join the step's logs before the trackers and
                                           # metrics.jsonl read them
            self.callback_handler.callbacks.insert(0, ValidationCurve(extras.validation, self.run_dir))
        self.cadence = extras.cadence
        if extras.cadence is not None:
            self.add_callback(extras.cadence)
        self.add_callback(ReleaseHostMemory())  # freed step memory back to the OS: RSS stays flat (host_memory.py)
        if extras.validation is not None and extras.validation.started is not None:  # the curve's step 0, measured
            # before GRPO, to the trackers too: added last, so the trackers are set up when it logs
            self.add_callback(start_to_trackers(self, extras.validation.started))
        self.dynamic_sampling_draws = extras.dynamic_sampling_draws
        if extras.dynamic_sampling_reward is not None:
            self.dynamic_sampling_reward = extras.dynamic_sampling_reward
            self.dynamic_sampling_column = extras.dynamic_sampling_column
        self.is_ratio_from_loss = extras.is_ratio_from_loss  # read only where RatioFromLoss is mixed in (TRL's trainer)
        self.shared_prompt = extras.shared_prompt  # read only where SharedPrompt is mixed in (TRL's trainer)
        self.effective_settings = effective_grpo_settings(self, extras.asked)  # before our samplers switch use_vllm on

    def run_state(self) -> dict:
        step = self.state.global_step
        return {
            "global_step": step,
            "max_steps": self.state.max_steps,
            "epoch": self.state.epoch,
            # where the data stands; transformers re-derives the dataloader position from global_step
            "data_position": {f"{k}_seen": v * step for k, v in self.data_per_step.items()},
            **self.nonfinite_guard.state(),
            **(self.completions_log.state() if self.completions_log is not None else {}),
        }

    def save_checkpoint_with(self, step: int, write_trainer_files) -> Path:
        several = self.accelerator.num_processes > 1
        return self.run_dir.save_checkpoint(step, write_trainer_files, self.run_state(), self.keep_checkpoints,
                                            shared_staging=several, barrier=self.accelerator.wait_for_everyone)

    def train(self, *args, **kwargs):
        try:
            with environment_set(self.run_environment):  # unsloth's loss reads the IS mode while it trains
                return super().train(*args, **kwargs)
        finally:  # also when training raises: the error line must not land on the bar's line
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ProgressBar) and callback.bar is not None:
                    callback.bar.close()


_TRAINER_CLASSES: dict = {}


def trainer_class() -> type:
    """`GRPORunTrainer`: RunTrainer over the GRPOTrainer `trl` exports now (trl_compat.grpo_trainer_base): stock
    TRL's, or on the unsloth backend unsloth's generated UnslothGRPOTrainer, the class a GPU run trains with."""
    base = grpo_trainer_base()
    if base not in _TRAINER_CLASSES:  # unsloth's trainer applies the ratio in its own loss: RatioFromLoss stays out
        bases = (RunTrainer, base) if is_unsloth_trainer(base) else (RunTrainer, RatioFromLoss, SharedPrompt, base)
        _TRAINER_CLASSES[base] = type("GRPORunTrainer", bases, {"__module__": __name__})
    return _TRAINER_CLASSES[base]


def build_trainer(handle, train_rows: list[dict], run_dir, rollouts=None, reward_funcs=None, validation=None,
                  answer_seconds=None, log=None):
    """TRL's GRPOTrainer for the handle's PEFT model, with our checkpoints, guards (guards.py),
    progress bar, metrics file and training-signal warnings. `run_dir`: a RunDir or its path.
    `rollouts`: a training.vllm_rollouts.TRLRollouts when generation is 'vllm' (rollouts from our vLLM
    engine through TRL's rollout_func, the adapter synced to it). `reward_funcs`: the reward functions GRPO
    trains with instead of the configured ones (the random-reward control, baseline.py); train.dynamic_sampling
    turns on trl_compat.DynamicSampling, mixed into every trainer built here. `validation`: a validation.Validation
    measuring the held-out curve (None: no curve). With log.completions_every > 0 completions.jsonl is written."""
    from datasets import Dataset

    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)

    plan = handle.plan.train
    install_logprob_fallback()  # TRL's log-prob kernel is Triton (GPU only): route CPU tensors to PyTorch
    asked = grpo_config_kwargs(handle.resolved, run_dir.path)  # with TRL's tool rounds (plans.tool_config_kwargs)
    user = user_code_of(plan)  # the run's callables, looked up once (user_code.load)
    tools = user.tool_functions()  # each call bounded in time, every answer text (tools.bounded)
    environment = user.bounded_environment()  # TRL builds it (one per concurrent rollout), methods bounded
    counted = tools + [fn for _, fn in environment_methods(environment)] if environment is not None else tools
    # each checked: one finite number per completion; correctness also logs all-right / all-wrong groups, and with
    # tools the first also logs the batch's tool use and keeps a transcript (tool_metrics.py)
    scored, tool_use = with_tool_use(
        with_group_outcomes(reward_funcs or user.reward_functions(), plan.num_generations), counted)
    if plan.completions is not None:  # each completion's truncation and gold answer into TRL's log (log_extra)
        scored = with_completion_facts(scored, _stop_ids(handle))
    generation_batch = handle.resolved.generation_batch_size
    written = plan.completions
    extras = RunExtras(
        run_dir=run_dir, tool_functions=counted, tool_use=tool_use, max_nonfinite_steps=plan.max_nonfinite_steps,
        learning_rate=plan.learning_rate, keep_checkpoints=plan.keep_checkpoints,
        data_per_step={"prompts": generation_batch // plan.num_generations, "completions": generation_batch},
        max_steps=plan.max_steps, beta=plan.beta, max_completion_length=plan.max_completion_length,
        completions=dict(every=written.every, groups=written.groups, max_mb=written.max_mb,
                         group_size=plan.num_generations, weights=list(plan.rewards.weights), max_steps=plan.max_steps,
                         logging_steps=plan.logging_steps) if written is not None else None,
        validation=validation, dynamic_sampling_draws=plan.dynamic_sampling_draws,
        dynamic_sampling_reward=plan.dynamic_sampling_reward, dynamic_sampling_column=plan.dynamic_sampling_column,
        is_ratio_from_loss=handle.resolved.is_from_loss, shared_prompt=plan.shared_prompt, asked=asked,
        adapter_check_every=plan.adapter_check_every, adapter_guard_steps=plan.adapter_guard_steps,
        environment=handle.resolved.trainer_environment,  # after load_model: {} where unsloth's vLLM did not start
        cadence=MeasuredCadence(plan, handle.resolved.step_seconds, asked["save_steps"], validation, answer_seconds,
                                log=log or tqdm.write))  # the step time measured, the cadence on it (cadence.py)
    trainer = trainer_class()(
        model=handle.model,
        processing_class=handle.tokenizer,
        reward_funcs=scored,
        args=grpo_config(**asked),
        train_dataset=Dataset.from_list(train_rows),
        extras=extras,
        **({"rollout_func": rollouts.rollout_func} if rollouts is not None else {}),
        **({"tools": tools} if tools else {}),  # multi-turn: TRL parses <tool_call>s, runs them, masks their results
        **({"environment_factory": environment} if environment is not None else {}),  # its methods are tools too
    )
    if rollouts is not None:
        rollouts.attach(trainer)  # importance-sampling correction + vllm/adapter_version in metrics.jsonl
    elif handle.resolved.is_correction and not asked["use_vllm"]:  # the model samples its own rollouts (our loop,
        sample_with(trainer, ModelSampler(trainer))  # transformers' generate): TRL's correction on their log-probs
    return trainer


def _stop_ids(handle) -> set:
    """The token ids that end a completion, as TRL 1.15 counts them (GRPOTrainer.__init__: the model's generation
    config's eos ids, the tokenizer's eos, and pad): one that ends without any was cut at max_completion_length."""
    eos = getattr(getattr(handle.model, "generation_config", None), "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    ids |= {handle.text_tokenizer.eos_token_id, handle.text_tokenizer.pad_token_id}
    return ids - {None}
