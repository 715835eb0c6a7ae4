"""The run's phases' settings, read from the config once, at the edge, into frozen plain values.

`run_plan(config)` builds a `RunPlan`; `resolve()` keeps it as `Resolved.plan` (and the model handle as
`handle.plan`). Every phase below the pipeline reads its own part: loading the model (`model`), priming (`prime`),
GRPO (`train`), the held-out measure and the curve (`eval`), and the pieces they share: how a question becomes a
prompt (`prompts`), the tool loop (`tools`) and the reward functions (`rewards`). None of them reads the config.

What the device decides (dtype, batch sizes, the generation path, ...) stays in `Resolved`; `grpo_config_kwargs`
joins the two into `GRPOConfig`'s arguments.

    plan = run_plan(config)
    plan.eval.batch_size, plan.train.num_generations, plan.prompts.template_kwargs
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lowvram_grpo.settings.config import RunConfig
from lowvram_grpo.settings.model_shapes import ModelFacts, model_facts

# GRPOConfig's importance-sampling mode by default: TRL 1.15's, one ratio per completion, masked above clip_max
IS_MODE = "sequence_mask"
# The trackers that show TRL's completions table (GRPOConfig.log_completions); the others get completions.jsonl only
COMPLETION_TRACKERS = ("wandb", "trackio")


# The model types fused_decode.py's layers cover (its SUPPORTED_TYPES): resolve refuses decode.fused elsewhere.
FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecodeSettings:
    """What resolve() decided for this run's transformers generation (config.DecodeConfig's `auto`s made concrete)."""
    loop: str          # 'lowvram' (this module's loop) | 'transformers' (transformers' generate, untouched)
    sampler: str       # one of decoding.SAMPLERS
    merge_lora: bool   # sampled tokens from the adapter merged into a copy of the 16-bit weights
    fused: bool = False  # sampled tokens through fused_decode.py's layers (merged or not, as merge_lora says)
    weights: str = "bf16"  # fused_decode.WEIGHTS: what the fused layers multiply with ('int8': FBGEMM's int8 linear)
    shared_prefill: bool = False  # rows with the same prompt prefilled once, its cache copied to each (shared_prompt)

    def describe(self, own: Optional[str] = None) -> str:
        """One phrase for --dry-run and the bench; `own`: what the model's own weights are ('bfloat16', '4-bit'),
        named as what sampled tokens read unless decode.weights=int8."""
        if self.loop == "transformers":
            return "transformers' generate"
        int8 = self.weights == "int8"
        reads = ("int8 weights (decode.weights=int8: the base packed once for FBGEMM's dynamic int8 linear)" if int8
                 else f"{own} weights" if own else "the model's own weights")
        merged = "unmerged on the int8 base" if int8 else "merged" if self.merge_lora else "unmerged"
        return (f"own decode loop, {self.sampler.replace('_', '-')} sampler, LoRA {merged} when sampling"
                + (", fused layers when sampling" if self.fused else "") + f"; sampled tokens read {reads}")


@dataclass(frozen=True)
class PromptPlan:
    """How a question becomes a prompt and how its answer is read."""
    system_prompt: Optional[str]
    answer_format: str                               # answers.extractors' format: 'xml', 'boxed', ...
    chat_template_kwargs: tuple[tuple[str, Any], ...]  # data.chat_template_kwargs' items (e.g. enable_thinking)
    max_seq_length: int                              # prompt + completion tokens the model is loaded for
    max_prompt_length: int = 0                       # train.max_prompt_length: longer prompts are dropped

    @property
    def template_kwargs(self) -> dict:
        """The chat template's extra arguments, as `apply_chat_template(**...)` takes them."""
        return dict(self.chat_template_kwargs)


@dataclass(frozen=True)
class ToolPlan:
    """The tool loop: tools.* and environment.*."""
    names: tuple[str, ...]
    module: Optional[str]
    max_turns: int
    timeout_seconds: float
    max_tokens_per_turn: Optional[int]
    turn_tokens: int                   # new tokens of one turn: max_tokens_per_turn, else train.max_completion_length
    environment: Optional[str]         # environment.name
    environment_module: Optional[str]
    used: bool                         # the run has a tool loop (RunConfig.uses_tools)


@dataclass(frozen=True)
class RewardPlan:
    """The reward functions by name, their weights and what a failing one does."""
    names: tuple[str, ...]
    weights: tuple[float, ...]        # one per name (rewards.weight_list)
    module: Optional[str]
    on_error: str


@dataclass(frozen=True)
class ModelPlan:
    """What loading the model reads: the checkpoint, the LoRA made on it, and the engine's share of the card."""
    name: str
    max_seq_length: int
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: tuple[str, ...]
    lora_random_state: int
    init_adapter: Optional[str]       # a saved adapter to start from (its settings are already in the lora_* above)
    gpu_memory_utilization: float     # the shared vLLM engine's share of the card (memory.gpu_memory_utilization)
    vllm_sync_steps: int              # GRPO steps between adapter syncs to our vLLM engine
    max_prompt_length: int = 0        # train.max_prompt_length (after_load checks the lengths against the model)
    max_completion_length: int = 0    # train.max_completion_length
    rollout_tokens: int = 0           # train.rollout_tokens: prompt + completion
    engine_sequences: int = 1         # sequences our vLLM engine decodes at once (memory_terms.engine_sequences)
    vllm_kv_cache_gb: Optional[float] = None  # memory.vllm_kv_cache_gb: our engine's KV cache, when set
    vllm_cpu_threads: Optional[int] = None    # memory.vllm_cpu_threads
    seed: int = 0                     # train.seed (our vLLM engine's sampling seed)
    # the model's shape and its local config.json, derived once for the run (model_shapes.model_facts): the checks,
    # resolve, the step-time estimate and the memory plan read this one
    facts: Optional[ModelFacts] = field(default=None, repr=False)

    def lora_kwargs(self) -> dict:
        """peft's `LoraConfig` arguments for this LoRA."""
        return dict(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                    target_modules=list(self.lora_target_modules), bias="none", task_type="CAUSAL_LM")


@dataclass(frozen=True)
class EvalPlan:
    """The greedy (or sampled) protocol of the held-out measure and of the validation curve."""
    enabled: bool
    temperature: float                # 0 = greedy
    top_p: float
    seed: int
    batch_size: int
    samples: int                      # k answers per question for mean@k / pass@k (0 = none)
    sample_temperature: float
    max_tokens: int                   # new tokens of an answer (train.max_completion_length)
    max_steps: int                    # the run's GRPO steps (a reward function's trainer_state sees them)
    prompts: PromptPlan
    tools: ToolPlan
    rewards: RewardPlan

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class PrimePlan:
    """Supervised priming on worked solutions before GRPO."""
    steps: int
    learning_rate: float
    batch_size: int
    save_steps: int                   # priming steps between prime checkpoints (0: only at the end and at a stop)
    keep_checkpoints: int
    prompts: PromptPlan
    tools: ToolPlan
    rewards: RewardPlan


@dataclass(frozen=True)
class CompletionsPlan:
    """completions.jsonl: every N GRPO steps, the first K groups, capped at max_mb."""
    every: int
    groups: int
    max_mb: float


@dataclass(frozen=True)
class GRPOSettings:
    """train.*'s settings that GRPOConfig takes as they are (grpo_config_kwargs joins them with the device's)."""
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    warmup_ratio: float
    lr_scheduler_type: str
    temperature: float
    top_p: float
    epsilon: float
    loss_type: str
    scale_rewards: str
    mask_truncated_completions: bool
    importance_sampling_level: str
    epsilon_high: Optional[float]
    top_entropy_quantile: float
    max_grad_norm: float
    seed: int


@dataclass(frozen=True)
class TrainPlan:
    """What the GRPO trainer reads besides GRPOConfig's arguments (grpo_config_kwargs)."""
    num_generations: int
    max_steps: int
    learning_rate: float
    beta: float
    max_completion_length: int
    logging_steps: int
    keep_checkpoints: int
    max_nonfinite_steps: int
    completions: Optional[CompletionsPlan]   # None: no completions.jsonl
    dynamic_sampling_draws: int              # extra draws for groups without signal (0 = dynamic sampling off)
    dynamic_sampling_reward: Optional[str]   # the reward whose spread counts (None: the weighted total)
    dynamic_sampling_column: Optional[int]   # its index among rewards.names
    shared_prompt: bool                      # the group's prompt once in the loss and the decode loop's prefill
    shared_prompt_note: str                  # why on or off (train.shared_prompt; resolve.choose_shared_prompt)
    save_steps_auto: bool                    # train.save_steps null: the run's measured step time sets the cadence
    curve_auto: bool                         # eval.every_steps null: the measured step time re-decides the curve
    validation_size: int                     # the held-out curve's questions (eval.validation_size)
    prompts: PromptPlan
    tools: ToolPlan
    rewards: RewardPlan
    adapter_check_every: int = 0             # sampled tokens scored under adapter and base every N steps (0 = off)
    trackers: tuple[str, ...] = ()           # train.report_to's trackers (their modules: installed.path_modules)
    adapter_guard_steps: int = 0             # flagged scored steps in a row that stop the run (0 = warn only)
    save_steps: Optional[int] = None         # train.save_steps as asked (None: auto, resolve.choose_save_steps)
    grpo: Optional[GRPOSettings] = None      # train.*'s settings GRPOConfig takes as they are (grpo_config_kwargs)


@dataclass(frozen=True)
class RunPlan:
    """Every phase's settings, read from the config once (run_plan)."""
    model: ModelPlan
    prompts: PromptPlan
    tools: ToolPlan
    rewards: RewardPlan
    prime: PrimePlan
    train: TrainPlan
    eval: EvalPlan
    preset: str = ""                 # the preset the run's settings started from (summary.json, the report)

    def describe(self) -> str:
        """A line a phase: what each reads (plan.txt and --dry-run show it under the decided settings)."""
        m, p, t, e, tools = self.model, self.prime, self.train, self.eval, self.tools
        weights = ", ".join(f"{n} x{w:g}" for n, w in zip(self.rewards.names, self.rewards.weights))
        written = (f"completions.jsonl every {t.completions.every} step(s), {t.completions.groups} group(s), "
                   f"<= {t.completions.max_mb:g} MB" if t.completions else "no completions.jsonl")
        return "\n".join([
            "phases (plans.py: what each one reads)",
            f"  model: {m.name}, LoRA r={m.lora_r} alpha={m.lora_alpha} dropout={m.lora_dropout:g} on "
            f"{', '.join(m.lora_target_modules)}, seed {m.lora_random_state}"
            + (f", from {m.init_adapter}" if m.init_adapter else ""),
            f"  prime: {p.steps} step(s) of {p.batch_size} at lr {p.learning_rate:g}",
            f"  train: {t.max_steps} GRPO step(s), {t.num_generations} completions a prompt, up to "
            f"{t.max_completion_length} new tokens, lr {t.learning_rate:g}, beta {t.beta:g}; {written}"
            + (f"; dynamic sampling, {t.dynamic_sampling_draws} draw(s)" if t.dynamic_sampling_draws else ""),
            f"  prompt of a group: {'computed once' if t.shared_prompt else 'computed per completion'} "
            f"({t.shared_prompt_note})",
            f"  eval: {'greedy' if e.greedy else f'T={e.temperature:g} top-p {e.top_p:g}'}, "
            f"batch {e.batch_size}, up to "
            f"{e.max_tokens} new tokens" + (f", {e.samples} samples at T={e.sample_temperature:g}" if e.samples else "")
            + ("" if e.enabled else " (off)"),
            f"  rewards: {weights}; answers read as {self.prompts.answer_format}"
            + (f"; tools {', '.join(tools.names) or '-'}, environment {tools.environment or '-'}, "
               f"{tools.max_turns} round(s)" if tools.used else "; no tools"),
        ])


def run_plan(config: RunConfig, facts: Optional[ModelFacts] = None) -> RunPlan:
    """The frozen plan of `config`'s phases. `facts`: the model's, derived already for a plan of the same model.name
    (the memory plan's search re-plans changed settings of one model); derived here otherwise (model_facts)."""
    train, data, tools, env = config.train, config.data, config.tools, config.environment
    prompts = PromptPlan(system_prompt=data.system_prompt, answer_format=data.answer_format,
                         chat_template_kwargs=tuple(dict(data.chat_template_kwargs or {}).items()),
                         max_seq_length=config.model.max_seq_length, max_prompt_length=config.train.max_prompt_length)
    tool_plan = ToolPlan(names=tuple(tools.names), module=tools.module, max_turns=tools.max_turns,
                         timeout_seconds=tools.timeout_seconds, max_tokens_per_turn=tools.max_tokens_per_turn,
                         turn_tokens=config.turn_tokens, environment=env.name, environment_module=env.module,
                         used=config.uses_tools)
    rewards = RewardPlan(names=tuple(config.rewards.names), weights=tuple(config.rewards.weight_list),
                         module=config.rewards.module, on_error=config.rewards.on_error)
    shared = dict(prompts=prompts, tools=tool_plan, rewards=rewards)
    lora = config.lora
    model = ModelPlan(name=config.model.name, max_seq_length=config.model.max_seq_length, lora_r=lora.r,
                      lora_alpha=lora.alpha, lora_dropout=lora.dropout, lora_target_modules=tuple(lora.target_modules),
                      lora_random_state=lora.random_state, init_adapter=lora.init_adapter,
                      gpu_memory_utilization=config.memory.gpu_memory_utilization,
                      vllm_sync_steps=config.model.vllm_sync_steps, max_prompt_length=train.max_prompt_length,
                      max_completion_length=train.max_completion_length, rollout_tokens=train.rollout_tokens,
                      engine_sequences=max(train.generation_batch_size, config.eval.batch_size),
                      vllm_kv_cache_gb=config.memory.vllm_kv_cache_gb, vllm_cpu_threads=config.memory.vllm_cpu_threads,
                      seed=train.seed,
                      facts=facts if facts is not None and facts.name == config.model.name
                      else model_facts(config.model.name))
    p = config.prime
    prime = PrimePlan(steps=p.steps, learning_rate=p.learning_rate, batch_size=p.batch_size, save_steps=p.save_steps,
                      keep_checkpoints=train.keep_checkpoints, **shared)
    log = config.log
    dynamic = train.dynamic_sampling
    reward = (train.dynamic_sampling_reward if dynamic and train.dynamic_sampling_reward in config.rewards.names
              else None)
    train_plan = TrainPlan(
        num_generations=train.num_generations, max_steps=train.max_steps, learning_rate=train.learning_rate,
        beta=train.beta, max_completion_length=train.max_completion_length, logging_steps=train.logging_steps,
        keep_checkpoints=train.keep_checkpoints, max_nonfinite_steps=train.max_nonfinite_steps,
        completions=(CompletionsPlan(every=log.completions_every, groups=log.completions_groups,
                                     max_mb=log.completions_max_mb) if log.completions_every > 0 else None),
        dynamic_sampling_draws=train.dynamic_sampling_max_draws if dynamic else 0,
        dynamic_sampling_reward=reward,
        dynamic_sampling_column=config.rewards.names.index(reward) if reward is not None else None,
        shared_prompt=train.shared_prompt == "on",
        shared_prompt_note=("train.shared_prompt=on: in the loss and the decode loop's prefill"
                            if train.shared_prompt == "on"
                            else "train.shared_prompt=off, the default: opt-in, equal to the per-row computation only "
                                 "up to float rounding"),
        save_steps_auto=train.save_steps is None, curve_auto=config.eval.every_steps is None,
        validation_size=config.eval.validation_size,
        adapter_check_every=train.adapter_check_every, adapter_guard_steps=train.adapter_guard_steps,
        trackers=tuple(train.trackers), save_steps=train.save_steps,
        grpo=GRPOSettings(
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, weight_decay=train.weight_decay,
            warmup_ratio=train.warmup_ratio, lr_scheduler_type=train.lr_scheduler_type, temperature=train.temperature,
            top_p=train.top_p, epsilon=train.epsilon, loss_type=train.loss_type, scale_rewards=train.scale_rewards,
            mask_truncated_completions=train.mask_truncated_completions,
            importance_sampling_level=train.importance_sampling_level, epsilon_high=train.epsilon_high,
            top_entropy_quantile=train.top_entropy_quantile, max_grad_norm=train.max_grad_norm, seed=train.seed),
        **shared)
    ev = config.eval
    eval_plan = EvalPlan(enabled=ev.enabled, temperature=ev.temperature, top_p=ev.top_p, seed=ev.seed,
                         batch_size=ev.batch_size, samples=ev.samples, sample_temperature=ev.sample_temperature,
                         max_tokens=train.max_completion_length, max_steps=train.max_steps, **shared)
    return RunPlan(model=model, prompts=prompts, tools=tool_plan, rewards=rewards, prime=prime, train=train_plan,
                   eval=eval_plan, preset=config.preset)


def tool_config_kwargs(tools: ToolPlan, use_vllm: bool = False) -> dict:
    """GRPOConfig's tool settings: with tools.names or an environment, max_tool_calling_iterations = tools.max_turns
    (TRL: rounds of running the latest turn's tool calls and generating on) and, with tools.max_tokens_per_turn,
    TRL's generation_kwargs capping every turn's new tokens (TRL's tool loop caps each at max_completion_length):
    `max_tokens` for a vLLM engine (SamplingParams), `max_new_tokens` for transformers' generate. Without tools,
    nothing: GRPOConfig as TRL sets it."""
    if not tools.used:
        return {}
    kwargs: dict = {"max_tool_calling_iterations": tools.max_turns}
    if tools.max_tokens_per_turn is not None:
        key = "max_tokens" if use_vllm else "max_new_tokens"
        kwargs["generation_kwargs"] = {key: tools.max_tokens_per_turn}
    return kwargs


def grpo_config_kwargs(resolved, output_dir: Path) -> dict:
    """`GRPOConfig`'s arguments: the run's GRPO settings (its plan: `resolved.plan`) and the resolved device settings
    (resolve.py), with the tool loop's rounds (tool_config_kwargs)."""
    plan = resolved.plan
    t, g = plan.train, plan.train.grpo
    kwargs = dict(
        output_dir=str(output_dir),
        learning_rate=t.learning_rate,
        adam_beta1=g.adam_beta1,
        adam_beta2=g.adam_beta2,
        weight_decay=g.weight_decay,
        warmup_steps=g.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of max_steps
        lr_scheduler_type=g.lr_scheduler_type,
        optim=resolved.optim,
        per_device_train_batch_size=resolved.per_device_train_batch_size,
        gradient_accumulation_steps=resolved.gradient_accumulation_steps,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        temperature=g.temperature,
        top_p=g.top_p,
        beta=t.beta,
        epsilon=g.epsilon,
        loss_type=g.loss_type,
        scale_rewards=g.scale_rewards,
        mask_truncated_completions=g.mask_truncated_completions,
        importance_sampling_level=g.importance_sampling_level,  # GSPO: sequence
        epsilon_high=g.epsilon_high,  # DAPO's clip-higher; None = epsilon
        top_entropy_quantile=g.top_entropy_quantile,
        max_grad_norm=g.max_grad_norm,
        max_steps=t.max_steps,
        save_strategy="steps",
        save_steps=resolved.save_steps,  # train.save_steps, or auto's choice (resolve.choose_save_steps)
        logging_steps=t.logging_steps,
        seed=g.seed,
        data_seed=g.seed,
        reward_weights=list(plan.rewards.weights),
        chat_template_kwargs=plan.prompts.template_kwargs or None,  # e.g. enable_thinking
        use_vllm=resolved.use_vllm,  # only unsloth's engine, which shares the weights; never a second TRL engine
        # resolve.choose_is_correction: on wherever a vLLM engine samples (unsloth's GRPOConfig would default it off)
        vllm_importance_sampling_correction=resolved.is_correction,
        vllm_importance_sampling_mode=resolved.is_mode or IS_MODE,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=plan.model.gpu_memory_utilization,
        vllm_max_model_length=resolved.vllm_max_model_len,
        gradient_checkpointing=resolved.gradient_checkpointing != "false",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=resolved.bf16,
        fp16=resolved.fp16,
        use_cpu=not resolved.cuda,
        report_to=list(t.trackers),  # TRL's integrations; metrics.jsonl is written either way
        # TRL's completions table for the trackers that show one (W&B, trackio; never printed: completions.jsonl has
        # them)
        log_completions=bool(set(t.trackers) & set(COMPLETION_TRACKERS)) and t.completions is not None,
        num_completions_to_print=0,
        disable_tqdm=True,  # our ProgressBar replaces HF's bar and its printed log dicts
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # several processes (accelerate): every LoRA weight takes part in each forward, so DDP need not search
        ddp_find_unused_parameters=False if resolved.num_processes > 1 else None,
    )
    kwargs.update(tool_config_kwargs(resolved.plan.tools, kwargs["use_vllm"]))  # TRL's rounds
    return kwargs
