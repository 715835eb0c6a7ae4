"""Every reach into TRL's and transformers' internals, in one place, checked against the versions it was written for.

Written for trl 1.15.0 and transformers 5.17.0 (the pins of requirements*.txt). At import this module
checks that each private hook below exists with the parameters we call it with; a missing one raises
`BackendError` saying to install the pinned versions. Another version with the same hooks works, with
one warning line. The reaches, and why each is needed:

- `TrainerHooks`, mixed over the GRPOTrainer that `trl` exports when the trainer is built
  (`grpo_trainer_base()`: TRL's own, or unsloth's generated `UnslothGRPOTrainer` once PatchFastRL has
  replaced it; both are transformers.Trainer subclasses), four private transformers.Trainer methods
  overridden, each handing off to a hook our trainer sets in its constructor (training.grpo.RunTrainer):
  * `_save_checkpoint(model, trial)` + `_get_output_dir(trial)`: checkpoints are written under a hidden
    staging dir and renamed into place with our run state (`save_checkpoint_with(step, write_files)`;
    run_dir.RunDir.save_checkpoint), so a checkpoint that exists is complete;
  * `_get_grad_norm(model, grad_norm)`: the gradient norm before clipping goes to `grad_norm_observer`
    (guards.NonFiniteGuard: an inf norm must skip the step although clipping scales the grads to 0);
  * `_load_from_checkpoint(resume_from_checkpoint, model)`: after transformers' own loading,
    `restore_trained_adapter` puts the checkpoint's trained adapter back (transformers 5.17, given a
    checkpoint with adapter sub-folders such as TRL's frozen 'ref' copy, loads only those).
- `sample_with(trainer, sampler)`: TRL 1.15 applies its importance-sampling correction (the sampler's
  log-probs vs the trainer's, for a sampler that is not exactly the policy) only when `use_vllm` is on,
  and `use_vllm=True` in GRPOConfig would start TRL's own vLLM engine. For rollouts from our own engine
  (TRL's public `rollout_func`), the built trainer's `use_vllm` attribute is switched on afterwards and
  `vllm_generation` is our sampler, whose `sync_weights()` TRL calls before a rollout when the step moved
  (adapter-only sync: backends/vllm/). For the trained model's own rollouts, `ModelSampler` is that sampler: it
  runs TRL's transformers branch of `_generate_single_turn` (use_vllm off for the call) with the sampler's
  log-probs captured (decoding.sampler_logprobs, or transformers' output_scores).
- `install_logprob_fallback()`: TRL 1.15 computes completion log-probs through a Triton-only fused LM
  head (`trl.trainer.utils._ChunkedLogProbFunction`); on a CPU it has no kernel. A dispatcher takes its
  place: the Triton kernel for CUDA/XPU tensors, logprobs_fallback.torch_chunked_logprobs (the same
  maths in PyTorch) for the rest. `LOWVRAM_GRPO_LOGPROBS=torch|triton` forces a path.
- `SampledTokenScores` (train.adapter_check_every; the guard of training/adapter_check.py): the rollouts' sampled tokens
  scored under the adapter and the base (adapter disabled) on every generation path: `_generate_and_score_completions`
  wrapped (the base's pass), `_compute_loss` / `_get_per_token_logps_and_entropies` (the adapter's side from the loss's
  own forward), TRL's `_metrics` (its section below).
- `DynamicSampling` (train.dynamic_sampling, DAPO): `_generate_and_score_completions(inputs)` and
  `_calculate_rewards(inputs, prompts, completions, completion_ids_list)` wrapped, so groups whose rewards are
  all equal are replaced by newly drawn groups with signal in the batch TRL trains on (its section below).
- `completion_log(trainer)`: the latest rollouts as TRL 1.15 keeps them for its `log_completions` (the private
  `_logs`: prompts, completions with their tool calls, each reward function's scores, advantages, what reward
  functions logged through `log_extra`), which completions.jsonl is written from (its section below).
- `sampling_settings(trainer)`: TRL's GRPOTrainer's sampling settings (temperature, top_p, top_k, min_p,
  repetition_penalty, eos_token_ids, max_completion_length: attributes its __init__ sets), read by our vLLM rollouts.
- `insert_callback(trainer, callback, before)`, `trainer_callbacks(trainer)`, `set_trainer_state(trainer, state)`: the
  built trainer's callback list (transformers' add_callback only appends) and its state (a checkpoint's, when a resumed
  run has no step left); nothing outside this module and the trainer's own constructor changes a built trainer.
  transformers' generation, PEFT's and torch's private names go through core/internals.py, the sibling door.
- `TRL_ROLLOUT_METHODS`: the names of GRPOTrainer's private methods that generate and score the rollouts.
  oom.oom_phase reads them in an out-of-memory traceback to tell the rollout from the training step;
  `check_versions` refuses a TRL whose GRPOTrainer lacks one (its out-of-memory advice would be wrong).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import transformers
import trl
from transformers import Trainer
from trl.trainer import utils as trl_utils

from lowvram_grpo.core import internals
from lowvram_grpo.model.decoding import loop_takes, sampler_logprobs
from lowvram_grpo.core.errors import AdapterError, BackendError
from lowvram_grpo.training.shared_prompt import MASKED_ATTENTION, pack, packed_logps
from lowvram_grpo.report.learning_signals import (
    ADAPTER_VS_BASE_KEY,
    SAMPLER_BASE_GAP_KEY,
    SAMPLER_GAP_KEY,
    SAMPLER_GAP_MAX_KEY,
)

WRITTEN_FOR = {"trl": "1.15.0", "transformers": "5.17.0"}
# the private hooks: (owner, method, parameters after self)
HOOKS = (
    (Trainer, "_save_checkpoint", ("model", "trial")),
    (Trainer, "_get_output_dir", ("trial",)),
    (Trainer, "_get_grad_norm", ("model", "grad_norm")),
    (Trainer, "_load_from_checkpoint", ("resume_from_checkpoint", "model")),
)
LOGPROB_ATTRIBUTE = "_ChunkedLogProbFunction"  # trl.trainer.utils
ENV = "LOWVRAM_GRPO_LOGPROBS"


def check_versions(warn=None) -> list[str]:
    """Raise BackendError when a hook we override is gone or changed; warn once when the versions differ
    from those this module was written for. Returns the problems found (for tests)."""
    installed = {"trl": trl.__version__, "transformers": transformers.__version__}
    missing = []
    for owner, name, params in HOOKS:
        method = getattr(owner, name, None)
        if method is None or tuple(inspect.signature(method).parameters)[1:] != params:
            missing.append(f"{owner.__name__}.{name}({', '.join(params)})")
    if not hasattr(trl_utils, LOGPROB_ATTRIBUTE):
        missing.append(f"trl.trainer.utils.{LOGPROB_ATTRIBUTE}")
    missing += missing_rollout_methods(trl.GRPOTrainer)  # section: TRL's rollout methods (below)
    missing += missing_single_turn(trl.GRPOTrainer)  # ModelSampler (below sample_with)
    missing += missing_completion_log(trl.GRPOTrainer)  # section: the completions of a step (below)
    missing += missing_sampling_attributes(trl.GRPOTrainer)  # sampling_settings (below sample_with)
    if not is_unsloth_trainer(trl.GRPOTrainer):  # unsloth's generated trainer wraps them; dynamic sampling and the
        missing += missing_dynamic_sampling_hooks(trl.GRPOTrainer)  # ratio from the loss are kept off there (resolve):
        missing += missing_ratio_hooks(trl.GRPOTrainer)  # their sections below
        missing += missing_shared_prompt_lines(trl.GRPOTrainer)
    pins = ", ".join(f"{k}=={v}" for k, v in WRITTEN_FOR.items())
    if missing:
        raise BackendError(f"lowvram_grpo overrides {', '.join(missing)}, which trl {installed['trl']} / transformers "
                           f"{installed['transformers']} do not have as expected: install the pinned versions "
                           f"(pip install {pins.replace(', ', ' ')})")
    if installed != WRITTEN_FOR:
        (warn or _warn)(f"warning: lowvram_grpo was written for {pins} (requirements*.txt); "
                        f"found trl {installed['trl']}, "
                        f"transformers {installed['transformers']}: its checkpoint and log-prob hooks are present, "
                        "but if training misbehaves install the pinned versions")
    return missing


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def grpo_trainer_base() -> type:
    """The GRPOTrainer class `trl` exports now: TRL's own, or unsloth's `UnslothGRPOTrainer` after
    `PatchFastRL` (backends/unsloth_backend.prepare) replaced it. Read when a trainer is built, never at
    import, so the order in which modules were imported cannot pick the wrong one."""
    return trl.GRPOTrainer


def trainer_name(trainer) -> str:
    """The GRPO trainer class a built trainer runs on (the first class of its MRO that is not ours)."""
    for cls in type(trainer).__mro__:
        if not cls.__module__.startswith("lowvram_grpo."):
            return cls.__name__
    return type(trainer).__name__


def is_unsloth_trainer(cls: type) -> bool:
    """True for unsloth's generated trainer (unsloth_compiled_cache/UnslothGRPOTrainer.py)."""
    return any(c.__name__ == "UnslothGRPOTrainer" for c in cls.__mro__)


class TrainerHooks:
    """The private overrides above, mixed in before a GRPOTrainer class (training.trainer_class). The hooks
    are set by training.grpo.RunTrainer.__init__: `checkpoint_saver(step, write_trainer_files) -> Path`,
    `grad_norm_observer(norm)`."""

    checkpoint_saver = None
    grad_norm_observer = None
    _staging_root = None

    def _get_output_dir(self, trial) -> str:
        # transformers writes checkpoint-N under this dir: during a save, the hidden staging root
        return str(self._staging_root) if self._staging_root is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        if self.checkpoint_saver is None:
            return super()._save_checkpoint(model, trial)

        def write_trainer_files(root: Path) -> None:
            self._staging_root = root
            try:
                super(TrainerHooks, self)._save_checkpoint(model, trial)
            finally:
                self._staging_root = None

        self.checkpoint_saver(self.state.global_step, write_trainer_files)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)  # the norm before clipping
        if self.grad_norm_observer is not None:
            self.grad_norm_observer(grad_norm)
        return grad_norm

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        restore_trained_adapter(model if model is not None else self.model, Path(resume_from_checkpoint))


def restore_trained_adapter(model, checkpoint: Path) -> None:
    """Load the checkpoint's top-level adapter weights into the trained 'default' adapter, in place.

    Why: transformers 5.17's Trainer, when a checkpoint has adapter sub-folders (TRL's frozen 'ref'
    copy of the adapter, made when beta > 0), loads only those and leaves 'default' at its initial
    weights; a resumed run would silently restart the adapter from scratch."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights, adapter_name="default")
    if getattr(result, "unexpected_keys", None):
        raise AdapterError(f"checkpoint {checkpoint} does not fit this model: unexpected weights "
                           f"{', '.join(result.unexpected_keys[:3])}")


SAMPLER_ATTRIBUTES = ("use_vllm", "vllm_importance_sampling_correction", "_generate", "rollout_func")


def sample_with(trainer, sampler) -> None:
    """Make TRL's GRPOTrainer treat `sampler` (an object with `sync_weights()`) as its vLLM generation, so its
    importance-sampling correction runs on the sampling log-probs the rollout_func returns; no engine of TRL's."""
    missing = [name for name in SAMPLER_ATTRIBUTES if not hasattr(trainer, name)]
    if missing:
        raise BackendError(f"this TRL's GRPOTrainer has no {', '.join(missing)}: the importance-sampling hook was "
                           f"written for trl {WRITTEN_FOR['trl']}; install it or set model.generation=transformers")
    trainer.use_vllm = True             # read after __init__ only by the generation and IS-correction code
    trainer.vllm_generation = sampler   # TRL calls .sync_weights() before a rollout when the step moved
    trainer._last_loaded_step = -1
    if isinstance(sampler, ModelSampler):
        trainer.vllm_mode = "server"    # read after __init__ only by the tool loop: the context ceiling is then the
        # model's max_position_embeddings, as on TRL's transformers path (colocate would read a vLLM engine's)


# TRL 1.15's GRPOTrainer keeps the rollout's sampling settings as instance attributes its __init__ sets from the
# GRPOConfig and the tokenizer (not documented API): our vLLM engine samples with exactly these
# (training/vllm_rollouts.py), read here and nowhere else.
SAMPLING_ATTRIBUTES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "eos_token_ids",
                       "max_completion_length")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """What a rollout samples with, as the trainer holds it (SAMPLING_ATTRIBUTES), and the run's seed; `max_new_tokens`:
    one turn's cap where GRPOConfig.generation_kwargs sets it (tools.max_tokens_per_turn), else None."""
    temperature: float
    top_p: float
    top_k: int
    min_p: Optional[float]
    repetition_penalty: float
    eos_token_ids: tuple
    max_completion_length: int
    max_new_tokens: Optional[int]
    seed: int


def missing_sampling_attributes(trainer_class: type) -> list[str]:
    """The SAMPLING_ATTRIBUTES no `__init__` of `trainer_class` or its bases sets (read from their source): unsloth's
    generated UnslothGRPOTrainer sets none itself and inherits TRL's."""
    sources = []
    for cls in trainer_class.__mro__:
        if "__init__" in vars(cls):
            try:
                sources.append(inspect.getsource(vars(cls)["__init__"]))
            except (OSError, TypeError):  # a C type's or a generated class's source is not on disk
                continue
    source = "\n".join(sources)
    return [f"{trainer_class.__name__}.{name}" for name in SAMPLING_ATTRIBUTES if f"self.{name} =" not in source]


def sampling_settings(trainer) -> SamplingSettings:
    """The built trainer's sampling settings (SamplingSettings)."""
    values = {name: getattr(trainer, name) for name in SAMPLING_ATTRIBUTES}
    values["eos_token_ids"] = tuple(values["eos_token_ids"] or ())
    asked = (trainer.args.generation_kwargs or {}).get("max_new_tokens")
    return SamplingSettings(**values, max_new_tokens=asked, seed=trainer.args.seed)


def insert_callback(trainer, callback, before: tuple[str, ...] = ()) -> None:
    """Put `callback` in the built trainer's callback list before the first callback whose class is named in `before`
    (at the end when none is; first when `before` is empty): transformers' add_callback only appends, and a callback
    that adds to a step's logs must run before those that write them."""
    callbacks = trainer.callback_handler.callbacks
    index = next((i for i, c in enumerate(callbacks) if type(c).__name__ in before), len(callbacks)) if before else 0
    callbacks.insert(index, callback)


def trainer_callbacks(trainer) -> tuple:
    """The built trainer's callbacks, in the order they run."""
    return tuple(trainer.callback_handler.callbacks)


def set_trainer_state(trainer, state) -> None:
    """Make `state` (a transformers TrainerState, e.g. a checkpoint's) the built trainer's own."""
    trainer.state = state


# TRL 1.15's own generation of one turn (the transformers branch of GRPOTrainer._generate_single_turn), which
# ModelSampler runs with the sampler's log-probs captured; check_versions refuses a TRL whose signature differs.
SINGLE_TURN = ("_generate_single_turn",
               ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"))


def missing_single_turn(trainer_class: type) -> list[str]:
    """[GRPOTrainer._generate_single_turn(...)] when `trainer_class` lacks it with SINGLE_TURN's parameters, else []."""
    name, params = SINGLE_TURN
    method = getattr(trainer_class, name, None)
    if callable(method) and tuple(inspect.signature(method).parameters)[1:] == params:
        return []
    return [f"GRPOTrainer.{name}({', '.join(params)})"]


class ModelSampler:
    """The trained model's own generation (our decode loop, or transformers' generate) as TRL's vLLM generation, so
    TRL 1.15's importance-sampling correction (train.is_correction; `sample_with`) runs on the sampler's log-probs:
    `generate` runs TRL's own transformers branch of `_generate_single_turn` (its padding, generation config,
    eos cut) with the model's `generate` wrapped for the call, and returns each sampled token's log-prob as vLLM's
    processed_logprobs are (TRL's vLLM path asks for those): the float32 log_softmax of the scores after temperature,
    top-k and top-p, i.e. of the distribution the token was drawn from. Our loop records them while it samples
    (decoding.sampler_logprobs); a call our loop does not take goes to transformers' generate with
    output_scores=True (its processed scores: one [B, V] float tensor per new token held until the call ends)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def sync_weights(self) -> None:
        """Nothing to sync: the sampler is the trained model."""
    def generate(self, prompts: list, images=None, num_generations: int = 1, profiler=None):
        """TRL's VLLMGeneration.generate: (prompt ids, completion ids [up to the first eos], per-token [log-prob]
        lists, None) for `prompts` (token ids, one row per completion)."""
        import torch


        if images and any(images):
            raise BackendError("the importance-sampling correction of the model's own rollouts takes text prompts; "
                               "set train.is_correction=off")
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        inner = model.generate
        rows = []

        def generate(**kwargs):
            prompt_len = kwargs["input_ids"].shape[1]
            if loop_takes(model, kwargs):
                with sampler_logprobs(model) as steps:
                    sequences = inner(**kwargs)
                rows.append(torch.stack(steps, dim=1) if steps else sequences.new_zeros((len(sequences), 0)).float())
                return sequences
            out = inner(**kwargs, output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[:, prompt_len:]
            rows.append(torch.stack([s.float().log_softmax(dim=-1).gather(-1, tokens[:, i:i + 1]).squeeze(-1)
                                     for i, s in enumerate(out.scores)], dim=1) if out.scores
                        else tokens.new_zeros(tokens.shape).float())
            return out.sequences

        own = internals.replace_generate(model, generate)  # decoding.install's loop, if any: put back after
        trainer.use_vllm = False  # TRL's transformers branch
        try:
            with profiler if profiler is not None else contextlib.nullcontext():
                completion_ids, _ = trainer._generate_single_turn(prompts, images, {}, num_generations)
        finally:
            trainer.use_vllm = True
            internals.restore_generate(model, own)
        logprobs = rows[0].cpu().tolist()
        return (prompts, completion_ids,
                [[[lp] for lp in row[:len(ids)]] for row, ids in zip(logprobs, completion_ids)], None)


def use_torch_logprobs(device_type: str, kernel_available: bool) -> bool:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced == "torch":
        return True
    if forced == "triton":
        return False
    return not (kernel_available and device_type in ("cuda", "xpu"))


def install_logprob_fallback() -> None:
    """Route TRL's fused-LM-head log-probs by device (idempotent)."""
    from lowvram_grpo.training.logprobs_fallback import torch_chunked_logprobs  # loads torch

    current = getattr(trl_utils, LOGPROB_ATTRIBUTE, None)
    if getattr(current, "_lowvram_dispatch", False):
        return
    kernel = current

    class ChunkedLogProbDispatch:
        _lowvram_dispatch = True
        triton_kernel = kernel

        @staticmethod
        def apply(hidden, *args, **kwargs):
            if use_torch_logprobs(hidden.device.type, kernel is not None):
                return torch_chunked_logprobs(hidden, *args, **kwargs)
            return kernel.apply(hidden, *args, **kwargs)

    setattr(trl_utils, LOGPROB_ATTRIBUTE, ChunkedLogProbDispatch)


# --------------------------------------------------------------------------- TRL's rollout methods (oom.oom_phase)
# TRL 1.15's private GRPOTrainer methods that generate and score the rollouts: an out-of-memory raised inside one
# of them is the rollout's, not the training step's (oom.oom_phase matches these names against the frames of
# the traceback; unsloth's generated trainer keeps TRL's method names). check_versions refuses a TRL that lacks
# one; tests/test_memory.py raises inside the real methods.
TRL_ROLLOUT_METHODS = ("_generate_and_score_completions", "_generate", "_generate_single_turn")


def missing_rollout_methods(trainer_class: type) -> list[str]:
    """The TRL_ROLLOUT_METHODS that `trainer_class` has no method of, as check_versions reports them."""
    return [f"GRPOTrainer.{name}" for name in TRL_ROLLOUT_METHODS if not callable(getattr(trainer_class, name, None))]



# --------------------------------------------------------------------------- dynamic sampling (train.dynamic_sampling)
# DAPO's dynamic sampling, which TRL 1.15 does not have. `DynamicSampling` is mixed in before TRL's GRPOTrainer
# (training.RunTrainer) and wraps two private GRPOTrainer methods: `_generate_and_score_completions(inputs)` (one
# generation batch: the rows of its prompts, each repeated num_generations times in a row, in; the padded tensors
# TRL trains on, out) and `_calculate_rewards(...)`, to see every completion's rewards. A group whose weighted
# rewards are all equal (TRL's own test, a std close to 0; or fewer than two scorable completions) has advantage 0
# and no gradient: its slot goes to a new group that has signal. New prompts come from the training set in an
# order of their own (a permutation seeded by train.seed, the step and the round: a resumed run draws the same;
# TRL's sampler, and so the data order of later steps, is not touched; prompts already in the batch are skipped),
# rolled out and scored by the same private step, for at most `dynamic_sampling_draws` rounds; groups still
# without signal after them are kept. The batch keeps the shape TRL expects: as many groups as it drew, tensors
# re-padded to the widest part (prompts on the left, completions on the right, as TRL pads them), and
# `num_items_in_batch` recounted. Each group keeps the advantages TRL gave it (per group under scale_rewards
# group or none; under batch, the std of the part it was drawn in). TRL's own metrics (reward,
# frac_reward_zero_std, ...) average over every group sampled, dropped ones included; the cost is logged per
# generation batch under DYNAMIC_SAMPLING_KEYS. resolve.check_dynamic_sampling keeps it to the hf backend (unsloth's
# generated trainer adds keys of its own to the batch) and one process.
DYNAMIC_SAMPLING_HOOKS = (("_generate_and_score_completions", ("inputs",)),
                          ("_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list")))
DYNAMIC_SAMPLING_KEYS = ("dynamic_sampling/extra_rollouts", "dynamic_sampling/zero_signal_groups_dropped",
                         "dynamic_sampling/zero_signal_groups_kept", "dynamic_sampling/draws")
# TRL 1.15's rollout batch (text prompts), key by key: one value per row; left-padded (prompt side) and right-padded
# (completion side) tensors with their pad value (None: the tokenizer's pad token); recounted after a merge.
ROW_KEYS = ("advantages",)
LEFT_PADDED = {"prompt_ids": None, "prompt_mask": 0}
RIGHT_PADDED = {"completion_ids": None, "completion_mask": 0, "old_per_token_logps": 0.0,
                "sampling_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "importance_sampling_ratio": 1.0,
                "tool_mask": 1}
RECOUNTED = ("num_items_in_batch",)


def missing_dynamic_sampling_hooks(trainer_class: type) -> list[str]:
    """The DYNAMIC_SAMPLING_HOOKS `trainer_class` lacks or has with other parameters, as check_versions reports them."""
    missing = []
    for name, params in DYNAMIC_SAMPLING_HOOKS:
        method = getattr(trainer_class, name, None)
        if not callable(method) or tuple(inspect.signature(method).parameters)[1:] != params:
            missing.append(f"GRPOTrainer.{name}({', '.join(params)})")
    return missing


class DynamicSampling:
    """The mixin (see the section's comment). `dynamic_sampling_draws`: 0 = off, else the most extra rounds per
    generation batch (training.grpo.RunTrainer.__init__ sets it from train.dynamic_sampling /
    dynamic_sampling_max_draws)."""

    dynamic_sampling_draws = 0
    dynamic_sampling_column = None  # train.dynamic_sampling_reward: judge by that reward function's column alone
    dynamic_sampling_reward = None
    _dynamic_sampling_rewards = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.dynamic_sampling_draws:
            self._dynamic_sampling_rewards = rewards  # (completions, reward functions), gathered: one process here
        return rewards

    def _generate_and_score_completions(self, inputs):
        if not self.dynamic_sampling_draws or not self.model.training:  # off, or TRL's evaluation
            return super()._generate_and_score_completions(inputs)
        self._dynamic_sampling_rewards = None
        batch = super()._generate_and_score_completions(inputs)
        if self._dynamic_sampling_rewards is None:  # scored without _calculate_rewards: nothing to judge by
            return batch
        return self._batch_with_signal(inputs, batch)

    def _zero_signal_groups(self) -> list[bool]:
        """Per group of the rollout just scored: True when its rewards carry no signal (TRL's frac_reward_zero_std
        test)."""
        import torch
        from trl.trainer.utils import nanstd

        per_function = self._dynamic_sampling_rewards
        if self.dynamic_sampling_column is not None:  # one reward alone (DAPO's accuracy filter: correctness)
            totals = per_function[:, self.dynamic_sampling_column].clone()
        else:
            totals = (per_function * self.reward_weights.to(per_function.device).unsqueeze(0)).nansum(dim=1)
            totals[torch.isnan(per_function).all(dim=1)] = torch.nan  # unscorable: left out, as TRL leaves it out
        std = nanstd(totals.view(-1, self.num_generations), dim=1)
        return (torch.isnan(std) | torch.isclose(std, torch.zeros_like(std))).tolist()

    def _batch_with_signal(self, inputs: list, batch: dict) -> dict:
        size = self.num_generations
        zero = self._zero_signal_groups()
        parts, chosen = [batch], [(0, group) for group in range(len(zero))]  # slot -> (part, group in that part)
        slots = [group for group, no_signal in enumerate(zero) if no_signal]
        seen = {repr(row["prompt"]) for row in inputs}
        extra = rounds = 0
        for round_number in range(1, self.dynamic_sampling_draws + 1):
            if not slots:
                break
            rows = self._redrawn_rows(len(slots), seen, round_number)
            if not rows:  # the training set has no prompt left that is not in this batch
                break
            parts.append(super()._generate_and_score_completions([row for row in rows for _ in range(size)]))
            rounds, extra = rounds + 1, extra + len(rows) * size
            with_signal = [group for group, no_signal in enumerate(self._zero_signal_groups()) if not no_signal]
            for slot, group in zip(slots, with_signal):
                chosen[slot] = (len(parts) - 1, group)
            slots = slots[len(with_signal):]
        metrics = self._metrics["train"]
        for key, value in zip(DYNAMIC_SAMPLING_KEYS, (extra, sum(zero) - len(slots), len(slots), rounds)):
            metrics[key].append(float(value))
        if len(parts) == 1 or sum(zero) == len(slots):
            return batch  # nothing replaced
        return self._merged_batch(parts, chosen)

    def _redrawn_rows(self, count: int, seen: set, round_number: int) -> list[dict]:
        """`count` training rows whose prompts are not in `seen` (added to it), in an order fixed by the seed, the
        step and the round."""
        import torch

        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.state.global_step * 1_009
                                                  + round_number)
        rows = []
        for index in torch.randperm(len(self.train_dataset), generator=generator).tolist():
            row = self.train_dataset[index]
            key = repr(row["prompt"])
            if key in seen:
                continue
            seen.add(key)
            rows.append(row)
            if len(rows) == count:
                break
        return rows

    def _merged_batch(self, parts: list[dict], chosen: list[tuple[int, int]]) -> dict:
        """One rollout batch of the chosen groups, in TRL's layout."""
        import torch

        unknown = set(parts[0]) - set(ROW_KEYS) - set(LEFT_PADDED) - set(RIGHT_PADDED) - set(RECOUNTED)
        if unknown:
            raise BackendError(f"train.dynamic_sampling cannot merge the rollout batch's {', '.join(sorted(unknown))} "
                               f"(written for trl {WRITTEN_FOR['trl']}'s text-only batches): "
                               "set train.dynamic_sampling=false")
        size = self.num_generations
        pad_token = (getattr(self, "_tokenizer", None) or self.processing_class).pad_token_id
        merged = {}
        for key, value in parts[0].items():
            if key in RECOUNTED or value is None:
                merged[key] = value
                continue
            pieces = [parts[part][key][group * size:(group + 1) * size] for part, group in chosen]
            if value.dim() == 1:
                merged[key] = torch.cat(pieces)
                continue
            width = max(piece.size(1) for piece in pieces)
            left = key in LEFT_PADDED
            pad = (LEFT_PADDED if left else RIGHT_PADDED)[key]
            pad = pad_token if pad is None else pad
            padded = []
            for piece in pieces:
                if piece.size(1) < width:
                    filler = piece.new_full((piece.size(0), width - piece.size(1)), pad)
                    piece = torch.cat([filler, piece] if left else [piece, filler], dim=1)
                padded.append(piece)
            merged[key] = torch.cat(padded)
        loss_mask = merged["completion_mask"]
        if merged.get("tool_mask") is not None:
            loss_mask = loss_mask * merged["tool_mask"]
        merged["num_items_in_batch"] = loss_mask.sum()  # TRL: summed over processes; one process here
        return merged


# --------------------------------------------------------------------------- the completions of a step
# (log.completions_*)
# TRL 1.15 keeps the latest generation batch's rollouts in the private `GRPOTrainer._logs` (its `log_completions`
# machinery prints and uploads them from there): `prompt` and `completion` (as the reward functions saw them: text, or
# messages, a tool-calling completion's tool calls and tool results included), `rewards` {reward function name: one
# score per completion}, `advantages` (the whole batch's, gathered) and `extra` {column: one value per completion},
# what reward functions logged through TRL's public `log_extra` keyword. Each a deque of at most generation_batch_size,
# filled in _generate_and_score_completions whether log_completions is on or not. completions.jsonl
# (training.CompletionsWriter) reads it through `completion_log` at each logged step; check_versions refuses a TRL whose
# GRPOTrainer does not build and fill it so (read from its source: the attribute exists only on a built trainer).
COMPLETION_LOG_KEYS = ("prompt", "completion", "rewards", "advantages", "extra")


def missing_completion_log(trainer_class: type) -> list[str]:
    """['GRPOTrainer._logs[...]'] when no __init__ / _generate_and_score_completions of `trainer_class`'s classes (its
    MRO: unsloth's generated trainer wraps a copy of TRL's, which has them) builds / fills `_logs` with
    COMPLETION_LOG_KEYS (as check_versions reports it); [] when one does."""
    def sources(name: str) -> str:
        found = []
        for cls in trainer_class.__mro__:
            method = cls.__dict__.get(name)
            with contextlib.suppress(OSError, TypeError):
                found.append(inspect.getsource(method) if method is not None else "")
        return "\n".join(found)

    built, filled = sources("__init__"), sources("_generate_and_score_completions")
    absent = [key for key in COMPLETION_LOG_KEYS if f'"{key}": ' not in built or f'self._logs["{key}"]' not in filled]
    return [f"GRPOTrainer._logs[{', '.join(absent)}]"] if absent else []


def completion_log(trainer) -> dict:
    """The latest generation batch as TRL logged it: {'prompt': [...], 'completion': [...], 'rewards': {name: [...]},
    'advantages': [...], 'extra': {column: [...]}} as plain lists, one entry per completion (TRL's order: each
    prompt's num_generations completions in a row). BackendError when the built trainer has no such log."""
    logs = getattr(trainer, "_logs", None)
    if not isinstance(logs, dict) or any(key not in logs for key in COMPLETION_LOG_KEYS):
        raise BackendError(f"this GRPOTrainer keeps no completion log as trl {WRITTEN_FOR['trl']} does (_logs): "
                           "install the pinned trl, or set log.completions_every=0")
    return {"prompt": list(logs["prompt"]), "completion": list(logs["completion"]),
            "rewards": {name: list(values) for name, values in logs["rewards"].items()},
            "advantages": list(logs["advantages"]),
            "extra": {name: list(values) for name, values in logs["extra"].items()}}



# --------------------------------------------------------------------------- the ratio from the loss
# (train.is_logprobs)
# TRL 1.15's importance-sampling correction (use_vllm + vllm_importance_sampling_correction) scores every rollout batch
# with an extra no-grad forward of the policy in _generate_and_score_completions (old_per_token_logps) and takes the
# ratio exp(old - sampler's) there. Where generation and optimization are aligned (TRL's own test:
# gradient_accumulation_steps % (steps_per_generation x num_iterations) == 0, which GRPOConfig here always meets:
# num_iterations 1, steps_per_generation = gradient_accumulation_steps), nothing moves the weights between that
# forward and the loss's, and TRL's loss already uses its own forward's log-probs, detached, as the old ones. So
# `RatioFromLoss` (train.is_logprobs auto/loss on TRL's own trainer: resolve.choose_is_logprobs) leaves the extra
# forward out: `_generate_and_score_completions(inputs)` runs with the correction flag off for the call (TRL then
# skips the forward, the ratio and their metrics; the batch keeps sampling_per_token_logps), and `_compute_loss(model,
# inputs)` puts the ratio into the micro-batch right after `_get_per_token_logps_and_entropies(model, input_ids,
# attention_mask, logits_to_keep, ...)` returns the loss's log-probs and before TRL's loss multiplies by
# inputs["importance_sampling_ratio"]. The ratio is TRL's arithmetic (`is_ratio`, its four modes, NaN sampler
# log-probs counted as no difference) and the sampling/* metrics TRL logs with it are TRL's, over the whole generation
# batch (its micro-batches gathered until the last). check_versions reads TRL's lines it mirrors (RATIO_SOURCE).
RATIO_HOOKS = (("_compute_loss", ("model", "inputs")),
               ("_get_per_token_logps_and_entropies", ("model", "input_ids", "attention_mask", "logits_to_keep")))
RATIO_SOURCE = {  # method -> lines of TRL 1.15 that RatioFromLoss mirrors or relies on
    "_generate_and_score_completions": (
        "if self.args.gradient_accumulation_steps % generate_every != 0 or (",
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
        'sequence_level_is = self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]',
        "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
        'if self.vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:',
        'elif self.vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:',
        "invalid_mis_mask, value=0.0",
        "delta = delta[mask & ~torch.isnan(delta)]",
        "flat_is_ratio = vllm_importance_sampling_ratio[mask]",
        'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio'),
    "_compute_loss": (
        "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(",
        'old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps',
        'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]'),
}
RATIO_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max")


def missing_ratio_hooks(trainer_class: type) -> list[str]:
    """What RatioFromLoss needs of `trainer_class` (RATIO_HOOKS' signatures, RATIO_SOURCE's lines) and it lacks."""
    missing = [f"GRPOTrainer.{name}({', '.join(params)}, ...)" for name, params in RATIO_HOOKS
               if not callable(method := getattr(trainer_class, name, None))
               or tuple(inspect.signature(method).parameters)[1:1 + len(params)] != params]
    for name, lines in RATIO_SOURCE.items():
        with contextlib.suppress(OSError, TypeError):
            source = " ".join(inspect.getsource(getattr(trainer_class, name)).split())
            missing += [f"GRPOTrainer.{name}: {line}" for line in lines if " ".join(line.split()) not in source]
    return missing


def is_ratio(trainer_logps, sampler_logps, mask, mode: str, clip_min, clip_max):
    """TRL 1.15's importance-sampling ratio of `mode` (vllm_importance_sampling_mode) between the trainer's and the
    sampler's log-probs [B, T] under `mask` [B, T] (completion x tool mask): [B, T] for token_* modes, [B, 1] for
    sequence_* ones; truncated to [clip_min, clip_max] (*_truncate) or set to 0 outside it (*_mask)."""
    import torch

    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)
    raise BackendError(f"unknown vllm_importance_sampling_mode {mode!r} "
                       f"(trl {WRITTEN_FOR['trl']} knows token_truncate, "
                       "token_mask, sequence_truncate, sequence_mask)")


class RatioFromLoss:
    """The mixin (see the section's comment). `is_ratio_from_loss`: on (training.grpo.RunTrainer.__init__ sets it from
    resolve's is_from_loss); each rollout batch it leaves unscored is counted in `ratio_batches_from_loss`."""

    is_ratio_from_loss = False
    ratio_batches_from_loss = 0
    _ratio_inputs = None   # the micro-batch whose loss runs now, while its ratio is still to come
    _ratio_parts = None    # the generation batch's [(|delta| of scored tokens, ratios)], one a micro-batch so far

    def _ratio_deferred(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.is_ratio_from_loss and self.use_vllm and self.vllm_importance_sampling_correction
                and self.model.training and self.args.gradient_accumulation_steps % generate_every == 0)

    def _generate_and_score_completions(self, inputs):
        if not self._ratio_deferred():
            return super()._generate_and_score_completions(inputs)
        self.vllm_importance_sampling_correction = False  # read only by that method's forward, ratio and metrics
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True
        self.ratio_batches_from_loss += 1
        self._ratio_parts = []
        return batch

    def _compute_loss(self, model, inputs):
        if ("importance_sampling_ratio" in inputs or "sampling_per_token_logps" not in inputs
                or not self._ratio_deferred()):
            return super()._compute_loss(model, inputs)
        self._ratio_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ratio_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._ratio_inputs = self._ratio_inputs, None  # the loss's own forward: its first call
        if inputs is not None:
            self._add_ratio(inputs, out[0].detach())
        return out

    def _add_ratio(self, inputs: dict, trainer_logps) -> None:
        """inputs["importance_sampling_ratio"] from the loss's log-probs [B, T]; TRL's metrics once a batch is done."""
        import torch

        sampler_logps = inputs["sampling_per_token_logps"]
        mask = (inputs["completion_mask"] if "tool_mask" not in inputs
                else inputs["completion_mask"] * inputs["tool_mask"])
        ratio = is_ratio(trainer_logps, sampler_logps, mask, self.vllm_importance_sampling_mode,
                         self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio
        scored = mask.bool()
        delta = torch.abs(trainer_logps - sampler_logps)[scored]
        delta = delta[~torch.isnan(delta)]
        sequence_level = self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
        flat = ratio.flatten() if sequence_level else ratio[scored]
        parts = self._ratio_parts if self._ratio_parts is not None else []
        parts.append((delta, flat))
        self._ratio_parts = parts
        if len(parts) >= self.args.steps_per_generation:
            self._log_ratio_metrics(parts)
            self._ratio_parts = []

    def _log_ratio_metrics(self, parts: list) -> None:
        """TRL's sampling/* metrics of a generation batch (its micro-batches' parts), as its own path logs them."""
        import torch
        from trl.trainer.utils import nanmax, nanmin

        device = parts[0][0].device
        delta, flat = torch.cat([d for d, _ in parts]), torch.cat([f for _, f in parts])
        zero = torch.tensor(0.0, device=device)
        gather = self.accelerator.gather
        values = (gather(delta.mean() if delta.numel() else zero).mean().item(),
                  gather(delta.max() if delta.numel() else zero).max().item(),
                  nanmin(gather(flat.min() if flat.numel() else zero)).item(),
                  gather(flat.mean() if flat.numel() else zero).nanmean().item(),
                  nanmax(gather(flat.max() if flat.numel() else zero)).item())
        for key, value in zip(RATIO_METRICS, values):
            self._metrics["train"][key].append(value)



# --------------------------------------------------------------------------- the sampled tokens under adapter and base
# On every generation path (our decode loop, transformers' generate, unsloth's generate, our vLLM engine, unsloth's,
# tool turns), whether or not the importance-sampling correction is on, `SampledTokenScores` scores a generation
# batch's sampled completion tokens (tool results left out) under the adapter being trained and under the base model
# (the adapter disabled: PEFT's disable_adapter), every `adapter_check_every` GRPO steps: tokens the adapter sampled
# score higher under it on average (KL(adapter || base) >= 0 a token), tokens a sampler that skipped the adapter drew
# score higher under the base (-KL(base || adapter) <= 0): training.adapter_check judges it. The adapter's side is the
# loss's own forward (TRL 1.15's `_compute_loss` -> `_get_per_token_logps_and_entropies`, its first call; nothing
# extra); the base's is TRL's reference pass when beta > 0 and no 'ref' adapter (also the adapter disabled), else one
# no-grad pass of TRL's `_get_per_token_logps_and_entropies` with the adapter disabled, under torch.random.fork_rng
# (the run's RNG and its loss stay as they were). On unsloth's generated trainer, whose loss computes its log-probs its
# own way, both sides are scored at generation (the adapter's by the same no-grad pass with the adapter on, or TRL's
# old_per_token_logps when the correction computed them). The batch carries the base's log-probs to the loss under
# BASE_LOGPS (a [B, T] tensor: TRL's shuffle and split take any). Logged per scored step (ADAPTER_SCORE_METRICS):
# the mean of adapter - base a token and, where the sampler gave its log-probs, |sampler - base| beside TRL's
# |sampler - adapter| (sampling/sampling_logp_difference/*, logged here when TRL's correction is off).
BASE_LOGPS = "base_per_token_logps"
ADAPTER_SCORE_METRICS = (ADAPTER_VS_BASE_KEY, SAMPLER_BASE_GAP_KEY, SAMPLER_GAP_KEY, SAMPLER_GAP_MAX_KEY)
ADAPTER_CHECK_SECONDS_KEY = "sampling/adapter_check_seconds"  # the scoring's own passes in a scored step (its cost)


def base_is_reference(trainer) -> bool:
    """Whether TRL's reference log-probs of this trainer are the base model's: beta > 0, no reference model, and either
    no 'ref' adapter (TRL then disables the adapter) or a 'ref' adapter whose every lora_B is 0 (TRL 1.15 copies the
    PEFT model's adapter to 'ref' when training starts: a fresh LoRA's B is 0, so 'ref' is the base; a primed or
    loaded adapter's is not). Read once a trainer: 'ref' is frozen."""
    known = getattr(trainer, "_base_is_reference", None)
    if known is None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        known = trainer.beta != 0.0 and getattr(trainer, "ref_model", None) is None
        if known and "ref" in getattr(model, "peft_config", {}):
            ref_b = [p for name, p in model.named_parameters() if ".ref." in name and "lora_B" in name]
            known = bool(ref_b) and not any(bool(p.detach().any()) for p in ref_b)
        trainer._base_is_reference = known
    return known


class SampledTokenScores:
    """The mixin (see the section's comment), outermost of the trainer's rollout wrappers (training.grpo.trainer_class).
    `adapter_check_every`: 0 = off, else score the rollouts of every k-th GRPO step (RunTrainer.__init__ sets it from
    the plan); `adapter_score_observer(step, scores)`: called once a scored step's tokens are scored (the guard)."""

    adapter_check_every = 0
    adapter_score_observer = None
    adapter_scored_batches = 0
    _score_inputs = None   # the micro-batch whose loss runs now, while its adapter side is still to come
    _score_parts = None    # the generation batch's per-micro-batch sums so far

    def _scored_step(self) -> bool:
        every = self.adapter_check_every
        return bool(every) and self.model.training and (self.state.global_step + 1) % every == 0

    def _sampled_logps(self, batch: dict, adapter: bool):
        """The batch's completion tokens' log-probs [B, T] under the adapter (or the base: adapter disabled), one
        no-grad pass of TRL's own scoring; the run's RNG state kept (torch.random.fork_rng)."""
        import torch
        from trl.models.utils import disable_gradient_checkpointing

        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        model = self.accelerator.unwrap_model(self.model)
        devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
        off = contextlib.nullcontext() if adapter else model.disable_adapter()
        with torch.random.fork_rng(devices=devices), torch.no_grad(), off, \
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self._scored_step():
            return batch
        self.adapter_scored_batches += 1
        started = time.perf_counter()
        unsloth = is_unsloth_trainer(type(self))
        base = batch.get("ref_per_token_logps") if not unsloth and base_is_reference(self) else None
        base = base if base is not None else self._sampled_logps(batch, adapter=False)
        if unsloth:  # its loss scores its own way: the adapter's side now
            adapter = batch.get("old_per_token_logps")
            adapter = adapter if adapter is not None else self._sampled_logps(batch, adapter=True)
        self._metrics["train"][ADAPTER_CHECK_SECONDS_KEY].append(time.perf_counter() - started)  # its cost
        if unsloth:
            self._score_parts = []
            self._add_scores({**batch, BASE_LOGPS: base}, adapter, parts_total=1)
            return batch
        batch[BASE_LOGPS] = base
        self._score_parts = []
        return batch

    def _compute_loss(self, model, inputs):
        if BASE_LOGPS not in inputs:
            return super()._compute_loss(model, inputs)
        self._score_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._score_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._score_inputs = self._score_inputs, None  # the loss's own forward: its first call
        if inputs is not None:
            self._add_scores(inputs, out[0].detach(), parts_total=self.args.steps_per_generation)
        return out

    def _add_scores(self, inputs: dict, adapter_logps, parts_total: int) -> None:
        """One micro-batch's sums; the scored step's metrics and the observer's call once its batch is done."""
        import torch

        mask = inputs["completion_mask"] if inputs.get("tool_mask") is None else \
            inputs["completion_mask"] * inputs["tool_mask"]
        scored = mask.bool()
        base = inputs[BASE_LOGPS]
        part = {"tokens": float(scored.sum()), "adapter_minus_base": float((adapter_logps - base)[scored].sum())}
        sampler = inputs.get("sampling_per_token_logps")
        if sampler is not None:
            known = scored & ~torch.isnan(sampler)
            to_adapter = torch.abs(adapter_logps - sampler)[known]
            part.update(sampled_tokens=float(known.sum()), to_base=float(torch.abs(base - sampler)[known].sum()),
                        to_adapter=float(to_adapter.sum()),
                        to_adapter_max=float(to_adapter.max()) if to_adapter.numel() else 0.0)
        parts = self._score_parts if self._score_parts is not None else []
        parts.append(part)
        self._score_parts = parts
        if len(parts) >= parts_total:
            self._score_parts = None
            self._log_scores(parts)

    def _log_scores(self, parts: list) -> None:
        tokens = sum(p["tokens"] for p in parts)
        scores = {"tokens": tokens,
                  "adapter_minus_base": sum(p["adapter_minus_base"] for p in parts) / tokens if tokens else 0.0}
        metrics = self._metrics["train"]
        metrics[ADAPTER_SCORE_METRICS[0]].append(scores["adapter_minus_base"])
        sampled = sum(p.get("sampled_tokens", 0.0) for p in parts)
        if sampled:
            scores["sampler_to_base"] = sum(p["to_base"] for p in parts) / sampled
            scores["sampler_to_adapter"] = sum(p["to_adapter"] for p in parts) / sampled
            metrics[ADAPTER_SCORE_METRICS[1]].append(scores["sampler_to_base"])
            if not (self.use_vllm and self.vllm_importance_sampling_correction):  # else TRL's / RatioFromLoss's
                metrics[ADAPTER_SCORE_METRICS[2]].append(scores["sampler_to_adapter"])  # TRL's names, correction off
                metrics[ADAPTER_SCORE_METRICS[3]].append(max(p.get("to_adapter_max", 0.0) for p in parts))
        if self.adapter_score_observer is not None:
            self.adapter_score_observer(self.state.global_step + 1, scores)


# ------------------------------------------------------------------------- the group's prompt once
# (train.shared_prompt)
# TRL 1.15's `_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size, ...)`
# scores each row [prompt, completion] in full (labels: the completion's tokens; `model(..., fused_lm_head=True)`, the
# fused LM head add_fused_lm_head put on the model), so a group's prompt is computed once per completion. `SharedPrompt`
# (mixed in under RatioFromLoss, which reads what it returns) scores each chunk of rows TRL would score together as
# training.shared_prompt packs it: one sequence per distinct prompt, its completions in segments after it, through the
# same fused head (its `shift_labels`: pre-shifted labels, scored without shifting). A chunk it cannot pack (no shared
# prompt, a completion mask with holes), a multimodal batch, an MoE's aux loss or an attention without a 4D mask (flash
# attention) keeps TRL's own computation, counted in `shared_prompt_kept`. check_versions reads TRL's lines it mirrors.
SHARED_PROMPT_SOURCE = {
    "_get_per_token_logps_and_entropies": (
        "labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)",
        "labels[:, :-logits_to_keep] = -100",
        "with self.accelerator.autocast():",
        "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)",
        "all_logps.append(outputs.log_probs[:, -logits_to_keep:])",
        "all_entropies.append(outputs.entropy[:, -logits_to_keep:])"),
}
SHARED_PROMPT_HEAD = ("if shift_labels is None:", "labels = shift_labels")  # trl.trainer.utils.add_fused_lm_head


def missing_shared_prompt_lines(trainer_class: type) -> list[str]:
    """TRL's lines SharedPrompt mirrors (SHARED_PROMPT_SOURCE, SHARED_PROMPT_HEAD) that `trainer_class` / TRL lacks."""
    missing = []
    sources = {name: getattr(trainer_class, name, None) for name in SHARED_PROMPT_SOURCE}
    sources["add_fused_lm_head"] = getattr(trl_utils, "add_fused_lm_head", None)
    lines = {**SHARED_PROMPT_SOURCE, "add_fused_lm_head": SHARED_PROMPT_HEAD}
    for name, method in sources.items():
        with contextlib.suppress(OSError, TypeError):
            source = " ".join(inspect.getsource(method).split())
            missing += [f"{name}: {line}" for line in lines[name] if " ".join(line.split()) not in source]
    return missing


def _transformers_model(model):
    """The transformers model under `model`'s wrappers (DistributedDataParallel's `module`, PEFT's)."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def attention_implementation(model) -> str:
    """The attention implementation transformers runs `model` (a PEFT model or a PreTrainedModel, wrapped or not)
    with: 'sdpa', 'eager', 'flash_attention_2', ... (its config's private `_attn_implementation`)."""
    return str(getattr(getattr(_transformers_model(model), "config", None), "_attn_implementation", None))


class SharedPrompt:
    """The mixin (see the section's comment). `shared_prompt`: on (training.grpo.RunTrainer.__init__ sets it from the
    plan's train.shared_prompt); `shared_prompt_chunks`: chunks scored with the prompt once; `shared_prompt_kept`:
    {why: chunks} scored by TRL's own computation while it was on."""

    shared_prompt = False
    shared_prompt_chunks = 0
    shared_prompt_kept: dict = {}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **rest):
        import torch

        def own(start, end):
            return super(SharedPrompt, self)._get_per_token_logps_and_entropies(
                model, input_ids[start:end], attention_mask[start:end], logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                **{k: (v[start:end] if v is not None and start is not None else v) for k, v in rest.items()})

        why = None
        if not self.shared_prompt:
            return own(None, None)
        if compute_aux_loss:
            why = "an MoE's load-balancing loss"
        elif any(value is not None for value in rest.values()):
            why = "a multimodal batch"
        elif attention_implementation(model) not in MASKED_ATTENTION:
            why = f"{attention_implementation(model)} attention (no 4D mask)"
        if why is not None:
            self._keep(why)
            return own(None, None)
        batch_size = batch_size or input_ids.size(0)
        eager = attention_implementation(model) == "eager"
        additive = _transformers_model(model).get_input_embeddings().weight.dtype if eager else None  # eager adds it
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            packed = pack(input_ids[start:end], attention_mask[start:end], logits_to_keep)
            if isinstance(packed, str):
                self._keep(packed)
                chunk_logps, chunk_entropies, _ = own(start, end)
            else:
                self.shared_prompt_chunks += 1
                with self.accelerator.autocast():
                    chunk_logps, chunk_entropies = packed_logps(model, packed, compute_entropy, additive)
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _keep(self, why: str) -> None:
        kept = dict(self.shared_prompt_kept)
        kept[why] = kept.get(why, 0) + 1
        self.shared_prompt_kept = kept


check_versions()
