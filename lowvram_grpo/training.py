"""GRPO training through TRL's `GRPOTrainer`: the algorithm stays in TRL.

This module maps our config onto `GRPOConfig`, hands TRL the PEFT model, the reward functions (with
their weights) and the prompt rows, and adds three callbacks: a progress bar (step, reward, loss, time
left), a `metrics.jsonl` writer (one JSON object per logged step) and the training-signal warnings
(signals.py: truncated completions, groups with all-equal rewards, a flat reward), plus the guards
(guards.py: NaN/inf steps skipped, Ctrl-C / SIGTERM at a step boundary). Checkpoints are written
atomically with our run state, and resuming restores the trained adapter (CheckpointingGRPOTrainer).

Choices, as in the Unsloth notebook: one prompt's group of `num_generations` completions per
micro-step (per_device_train_batch_size defaults to num_generations), advantages normalised within
each group (TRL's default), a KL penalty `beta` against the adapter-free base (no second model in
memory: PEFT disables the adapters for the reference pass), paged 8-bit AdamW.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import sys
from pathlib import Path

from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from . import checkpoints
from .guards import NonFiniteGuard, StopOnSignal
from .lora_io import atomic_replace_dir
from .rewards import reward_functions


def grpo_args(config, output_dir: Path, cuda: bool) -> GRPOConfig:
    t, mem = config.train, config.memory
    import torch

    bf16 = cuda and config.model.dtype in ("auto", "bfloat16") and torch.cuda.is_bf16_supported()
    fp16 = cuda and not bf16 and config.model.dtype != "float32"
    return GRPOConfig(
        output_dir=str(output_dir),
        learning_rate=t.learning_rate,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of max_steps
        lr_scheduler_type=t.lr_scheduler_type,
        optim=t.optim,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        top_p=t.top_p,
        beta=t.beta,
        epsilon=t.epsilon,
        loss_type=t.loss_type,
        scale_rewards=t.scale_rewards,
        mask_truncated_completions=t.mask_truncated_completions,
        max_grad_norm=t.max_grad_norm,
        max_steps=t.max_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        logging_steps=t.logging_steps,
        seed=t.seed,
        data_seed=t.seed,
        reward_weights=config.rewards.weight_list,
        use_vllm=config.model.fast_inference,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=mem.gpu_memory_utilization,
        gradient_checkpointing=mem.gradient_checkpointing != "false",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=bf16,
        fp16=fp16,
        use_cpu=not cuda,
        report_to="none",
        disable_tqdm=True,  # our ProgressBar replaces HF's bar and its printed log dicts
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )


class MetricsWriter(TrainerCallback):
    """Appends each logged step to metrics.jsonl: `step`, `reward`, `loss` and every other TRL metric."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        row = metric_row(state.global_step, logs)
        if row is None:
            return
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


def metric_row(step: int, logs) -> dict | None:
    """One training step's numbers as metrics.jsonl stores them (None for logs that are not a training step)."""
    if not logs or "reward" not in logs:  # the end-of-training summary has no reward
        return None
    row = {"step": step}
    for key, value in logs.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = value if math.isfinite(value) else None
    return row


class SignalWarnings(TrainerCallback):
    """Prints a training-signal warning (signals.py) the first time its pattern shows in the logged metrics."""

    def __init__(self, max_completion_length: int):
        from .signals import SignalMonitor

        self.monitor = SignalMonitor(max_completion_length)

    def on_log(self, args, state, control, logs=None, **kwargs):
        row = metric_row(state.global_step, logs)
        if row is None:
            return
        from tqdm.auto import tqdm

        for signal in self.monitor.add(row):
            tqdm.write(f"warning: {signal}", file=sys.stderr)  # above the progress bar, not through it


class ProgressBar(TrainerCallback):
    """A tqdm bar: step/total, time left, and the latest reward and loss."""

    def __init__(self, total: int, initial: int = 0):
        self.total, self.initial, self.bar = total, initial, None

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        initial = max(self.initial, state.global_step)  # a resumed run starts at its checkpoint's step
        self.bar = tqdm(total=self.total, initial=initial, desc="GRPO", unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "reward" in logs:
            self.bar.set_postfix(reward=f"{logs['reward']:.3f}", loss=f"{logs.get('loss', float('nan')):.4f}", refresh=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


class CheckpointingGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose checkpoints are written atomically with our run state (checkpoints.py),
    and whose resume restores the trained adapter. build_trainer sets the attributes below."""

    nonfinite_guard: NonFiniteGuard
    keep_checkpoints: int = 2
    metrics_path: Path
    data_per_step: dict
    _staging_root = None

    def _get_output_dir(self, trial) -> str:
        # transformers writes checkpoint-N under this dir: during a save, the hidden staging dir
        return str(self._staging_root) if self._staging_root is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = Path(self.args.output_dir)
        name = f"checkpoint-{self.state.global_step}"
        self._staging_root = Path(tempfile.mkdtemp(prefix=f"{checkpoints.STAGING_PREFIX}{os.getpid()}-", dir=run_dir))
        try:
            super()._save_checkpoint(model, trial)
            checkpoints.write_run_state(self._staging_root / name, self._run_state(), self.metrics_path)
            atomic_replace_dir(self._staging_root / name, run_dir / name)
        finally:
            shutil.rmtree(self._staging_root, ignore_errors=True)
            self._staging_root = None
        checkpoints.prune_checkpoints(run_dir, self.keep_checkpoints)

    def _run_state(self) -> dict:
        step = self.state.global_step
        return {
            "global_step": step,
            "max_steps": self.state.max_steps,
            "epoch": self.state.epoch,
            # where the data stands; transformers re-derives the dataloader position from global_step
            "data_position": {f"{k}_seen": v * step for k, v in self.data_per_step.items()},
            **self.nonfinite_guard.state(),
        }

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # also when training raises: the error line must not land on the bar's line
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ProgressBar) and callback.bar is not None:
                    callback.bar.close()

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)  # the norm before clipping
        self.nonfinite_guard.note_grad_norm(grad_norm)
        return grad_norm

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        checkpoints.restore_trained_adapter(model if model is not None else self.model, Path(resume_from_checkpoint))


def build_trainer(handle, config, train_rows: list[dict], output_dir: Path, cuda: bool) -> "CheckpointingGRPOTrainer":
    """TRL's GRPOTrainer for the handle's PEFT model, with our checkpoints, guards (guards.py),
    progress bar and metrics file."""
    from datasets import Dataset

    from . import logprobs_fallback

    logprobs_fallback.install()  # TRL's log-prob kernel is Triton (GPU only): route CPU tensors to PyTorch
    trainer = CheckpointingGRPOTrainer(
        model=handle.model,
        processing_class=handle.tokenizer,
        reward_funcs=reward_functions(config.rewards),  # each checked: one finite number per completion
        args=grpo_args(config, output_dir, cuda),
        train_dataset=Dataset.from_list(train_rows),
    )
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.nonfinite_guard = NonFiniteGuard(config.train.max_nonfinite_steps, config.train.learning_rate)
    trainer.stop_signals = StopOnSignal()
    trainer.keep_checkpoints = config.train.keep_checkpoints
    trainer.metrics_path = Path(output_dir) / "metrics.jsonl"
    trainer.data_per_step = {"prompts": config.train.generation_batch_size // config.train.num_generations,
                             "completions": config.train.generation_batch_size}
    trainer.add_callback(trainer.nonfinite_guard)  # before MetricsWriter: it adds skipped_nonfinite to the logs
    trainer.add_callback(trainer.stop_signals)
    trainer.add_callback(ProgressBar(config.train.max_steps))
    trainer.add_callback(MetricsWriter(Path(output_dir) / "metrics.jsonl"))
    trainer.add_callback(SignalWarnings(config.train.max_completion_length))
    return trainer
