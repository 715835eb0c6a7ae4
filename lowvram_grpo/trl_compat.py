"""Every reach into TRL's and transformers' internals, in one place, checked against the versions it was written for.

Written for trl 1.15.0 and transformers 5.17.0 (the pins of requirements*.txt). At import this module
checks that each private hook below exists with the parameters we call it with; a missing one raises
`BackendError` saying to install the pinned versions. Another version with the same hooks works, with
one warning line. The reaches, and why each is needed:

- `TrainerHooks`, mixed over the GRPOTrainer that `trl` exports when the trainer is built
  (`grpo_trainer_base()`: TRL's own, or unsloth's generated `UnslothGRPOTrainer` once PatchFastRL has
  replaced it; both are transformers.Trainer subclasses), four private transformers.Trainer methods
  overridden, each handing off to a hook the rest of the package sets (training.build_trainer):
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
  (adapter-only sync: backends/vllm/).
- `install_logprob_fallback()`: TRL 1.15 computes completion log-probs through a Triton-only fused LM
  head (`trl.trainer.utils._ChunkedLogProbFunction`); on a CPU it has no kernel. A dispatcher takes its
  place: the Triton kernel for CUDA/XPU tensors, logprobs_fallback.torch_chunked_logprobs (the same
  maths in PyTorch) for the rest. `LOWVRAM_GRPO_LOGPROBS=torch|triton` forces a path.
- `TRL_ROLLOUT_METHODS`: the names of GRPOTrainer's private methods that generate and score the rollouts.
  memory.oom_phase reads them in an out-of-memory traceback to tell the rollout from the training step;
  `check_versions` refuses a TRL whose GRPOTrainer lacks one (its out-of-memory advice would be wrong).
"""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import transformers
import trl
from transformers import Trainer
from trl.trainer import utils as trl_utils

from .errors import AdapterError, BackendError

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
    pins = ", ".join(f"{k}=={v}" for k, v in WRITTEN_FOR.items())
    if missing:
        raise BackendError(f"lowvram_grpo overrides {', '.join(missing)}, which trl {installed['trl']} / transformers "
                           f"{installed['transformers']} do not have as expected: install the pinned versions "
                           f"(pip install {pins.replace(', ', ' ')})")
    if installed != WRITTEN_FOR:
        (warn or _warn)(f"warning: lowvram_grpo was written for {pins} (requirements*.txt); found trl {installed['trl']}, "
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
    are set by training.build_trainer: `checkpoint_saver(step, write_trainer_files) -> Path`,
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


def use_torch_logprobs(device_type: str, kernel_available: bool) -> bool:
    forced = os.environ.get(ENV, "").strip().lower()
    if forced == "torch":
        return True
    if forced == "triton":
        return False
    return not (kernel_available and device_type in ("cuda", "xpu"))


def install_logprob_fallback() -> None:
    """Route TRL's fused-LM-head log-probs by device (idempotent)."""
    from .logprobs_fallback import torch_chunked_logprobs

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


# --------------------------------------------------------------------------- TRL's rollout methods (memory.oom_phase)
# TRL 1.15's private GRPOTrainer methods that generate and score the rollouts: an out-of-memory raised inside one
# of them is the rollout's, not the training step's (memory.oom_phase matches these names against the frames of
# the traceback; unsloth's generated trainer keeps TRL's method names). check_versions refuses a TRL that lacks
# one; tests/test_memory.py raises inside the real methods.
TRL_ROLLOUT_METHODS = ("_generate_and_score_completions", "_generate", "_generate_single_turn")


def missing_rollout_methods(trainer_class: type) -> list[str]:
    """The TRL_ROLLOUT_METHODS that `trainer_class` has no method of, as check_versions reports them."""
    return [f"GRPOTrainer.{name}" for name in TRL_ROLLOUT_METHODS if not callable(getattr(trainer_class, name, None))]


check_versions()
