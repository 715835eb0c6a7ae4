"""The TRL wiring: GRPO rollouts through TRL's `rollout_func` on the engine (TRLRollouts), TRL's
importance-sampling correction fed with the engine's sampling log-probs, and the run's engine started
for a model handle (start_for_run)."""
from __future__ import annotations

import contextlib
import os
from typing import Any

from lowvram_grpo.model.vllm.engine import OPEN_ENGINES, LocalVLLMEngine
from lowvram_grpo.model.vllm.settings import VLLMEngineError, settings_for
from lowvram_grpo.settings.model_shapes import shape_from_config


def _prompt_ids(tokenizer, prompt, trainer=None) -> list[int]:
    """A prompt's token ids as TRL's own generation path makes them (GRPOTrainer._tokenize_prompts, TRL 1.15): with
    the trainer's tools rendered into the template (`tools or None`, as TRL: some templates render tool boilerplate
    for an empty list), its chat_template and chat_template_kwargs."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    extra = {}
    if trainer is not None:
        extra = dict(tools=getattr(trainer, "tools", None) or None,
                     chat_template=getattr(trainer, "chat_template", None),
                     **(getattr(trainer, "chat_template_kwargs", None) or {}))
    encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True,
                                            **extra)
    return list(encoded["input_ids"])


def _runs(prompts: list) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): TRL repeats each prompt num_generations times in a row."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def _sampling(trainer):
    """trl_compat.sampling_settings of the built trainer (TRL's own attributes, read through the door)."""
    from lowvram_grpo.training.trl_compat import sampling_settings  # loads trl: a trainer exists by now

    return sampling_settings(trainer)


def turn_tokens(trainer) -> int:
    """Most new tokens of one turn: tools.max_tokens_per_turn as plans.tool_config_kwargs hands it to TRL
    (generation_kwargs' max_new_tokens: this engine stands in for transformers' generate), else TRL's cap for each
    turn, max_completion_length. TRL's tool loop cuts the whole trajectory at max_completion_length either way."""
    settings = _sampling(trainer)
    asked, cap = settings.max_new_tokens, settings.max_completion_length
    return min(asked, cap) if asked else cap


class TRLRollouts:
    """TRL's `rollout_func` on the vLLM engine, with the adapter synced every `sync_every` steps.

    `attach(trainer)` after building the GRPOTrainer: it turns on TRL's importance-sampling correction
    (see the module docstring) and adds the callback that logs the served adapter version."""

    def __init__(self, engine: LocalVLLMEngine, sync_every: int = 1, importance_sampling: bool = True):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every}")
        self.engine = engine
        self.sync_every = sync_every
        self.importance_sampling = importance_sampling
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental:
        # we pin TRL 1.15 and tests/test_vllm_engine.py checks the hook end to end
        self.trainer = None
        self.last = {}  # the latest rollout's adapter version / step, for the logs
        self.history: list[dict] = []  # every rollout's (global step, adapter version, adapter step, vLLM id)
        self.turns = 0  # turns generated after tool results in the current rollout (TRL's tool loop: generate())

    # TRL: self.vllm_generation.sync_weights() before a rollout whenever global_step moved
    def sync_weights(self) -> None:
        if self.trainer is not None:
            self.ensure_synced(self.trainer)

    def ensure_synced(self, trainer) -> None:
        step = trainer.state.global_step
        policy = self.engine.policy
        if policy is None or step - policy.step >= self.sync_every or step < policy.step:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self.engine.sync(model, step)

    def _sample(self, trainer, ids: list[list[int]], counts: list[int], seed: int):
        s = _sampling(trainer)
        return self.engine.sample(
            ids, counts, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, max_tokens=turn_tokens(trainer),
            stop_token_ids=list(s.eos_token_ids), seed=seed,
        )

    def rollout_func(self, prompts: list, trainer) -> dict:
        """The first turn of every completion. With tools, TRL's tool loop then runs the calls and asks generate()
        for each next turn: the multi-turn rollout stays on this engine."""
        self.trainer = trainer
        self.ensure_synced(trainer)
        self.turns = 0
        tokenizer = trainer.processing_class
        runs = _runs(prompts)
        ids = [_prompt_ids(tokenizer, p, trainer) for p, _ in runs]
        seed = _sampling(trainer).seed * 100_003 + trainer.state.global_step * 1_009  # same run, same samples
        groups = self._sample(trainer, ids, [k for _, k in runs], seed)
        policy = self.engine.policy
        self.last = {"vllm/adapter_version": policy.version, "vllm/adapter_step": policy.step,
                     "vllm/adapter_id": policy.request.lora_int_id}
        self.history.append({"step": trainer.state.global_step, **self.last})
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt_ids, group in zip(ids, groups):
            for tokens, logps in group:
                out["prompt_ids"].append(list(prompt_ids))
                out["completion_ids"].append(tokens)
                out["logprobs"].append(logps)
        return out

    # TRL's vLLM-generation interface, as its tool loop (GRPOTrainer._tool_call_loop via _generate_single_turn,
    # TRL 1.15) uses it once sample_with made this object the trainer's `vllm_generation`.
    @property
    def llm(self):
        """The engine's vLLM LLM: TRL's tool loop reads llm.llm_engine.model_config.max_model_len to drop a tool
        result that would not fit the context."""
        return self.engine.llm

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """The next turn after tool results: `prompts` are token ids (prompt + completion so far + the rendered tool
        results, built by TRL without re-tokenizing), sampled on the synced adapter with the rollout's settings.
        Returns TRL's (prompt ids, completion ids, per-token [log-prob] lists, extra) of VLLMGeneration.generate."""
        if images and any(images):
            raise VLLMEngineError("tool results with images are not supported on this engine")
        trainer = self.trainer
        self.ensure_synced(trainer)
        self.turns += 1
        seed = _sampling(trainer).seed * 100_003 + trainer.state.global_step * 1_009 + 7_919 * self.turns
        with profiler if profiler is not None else contextlib.nullcontext():
            groups = self._sample(trainer, [list(p) for p in prompts], [num_generations] * len(prompts), seed)
        completion_ids = [tokens for group in groups for tokens, _ in group]
        logprobs = [[[lp] for lp in logps] for group in groups for _, logps in group]
        return list(prompts), completion_ids, logprobs, None

    def attach(self, trainer) -> None:
        """Hook this into a built GRPOTrainer (TRL 1.15): the version logger and, when importance
        sampling is on, TRL's correction with sampling log-probs from this engine (no engine of TRL's)."""
        from transformers import TrainerCallback

        from lowvram_grpo.training.trl_compat import insert_callback, sample_with  # loads transformers

        self.trainer = trainer
        if self.importance_sampling:
            sample_with(trainer, self)  # TRL's importance-sampling correction with our sampling log-probs
        rollouts = self

        class AdapterVersionLog(TrainerCallback):
            """Adds the served adapter's version (and the step it was synced at) to each logged step."""
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs is not None and "reward" in logs and rollouts.last:
                    logs.update(rollouts.last)
                    stats = rollouts.engine.stats
                    if stats.sync_seconds:
                        logs["vllm/sync_seconds"] = stats.sync_seconds[-1]

        # before the metrics writer, so metrics.jsonl has the version
        insert_callback(trainer, AdapterVersionLog(), before=("MetricsWriter", "SignalWarnings"))


def start_for_run(handle, log=print) -> TRLRollouts:
    """Start the engine for `handle`'s base checkpoint, make it the handle's generation engine (the
    before/after evaluation samples through it) and return the rollouts for build_trainer."""

    sync_every, resolved = handle.plan.model.vllm_sync_steps, handle.resolved
    if isinstance(handle.engine, LocalVLLMEngine) and handle.engine.llm is not None:  # a handle trained before
        return TRLRollouts(handle.engine, sync_every=sync_every, importance_sampling=resolved.is_correction)
    shape = shape_from_config(handle.model.config.to_dict(), handle.base_model)  # the model loaded: hub ids too
    settings = settings_for(resolved, shape, handle.base_model)
    log(f"starting the vLLM engine: {settings.describe()} ...")
    try:
        engine = LocalVLLMEngine(settings, handle.tokenizer).start()
    except VLLMEngineError as exc:
        from lowvram_grpo.core.errors import EngineStopped  # optional: may be absent

        raise EngineStopped(f"the vLLM engine could not start: {exc}; it asked for a KV cache of "
                            f"{settings.kv_cache_bytes / 2**30:.2f} GiB for {settings.max_num_seqs} sequences of "
                            f"{settings.max_model_len} tokens: lower memory.vllm_kv_cache_gb, eval.batch_size or "
                            "model.max_seq_length, or set model.generation=transformers; nothing was written") from None
    OPEN_ENGINES.add(engine)
    handle.engine = engine
    return TRLRollouts(engine, sync_every=sync_every, importance_sampling=resolved.is_correction)
