"""The bad-input sweep: every CLI option and every config key with a wrong value ends in one
`error: ...` line on stderr, exit code 2, no traceback, and nothing written.

The cases are the lists below; `test_every_cli_option_has_a_case` and `test_every_config_key_has_a_case`
fail when an option or key is added without one. They run in-process through `lowvram_grpo.run.cli.main`
(they fail before any model loads, so the sweep takes seconds); `test_in_a_fresh_process` reruns a
sample as real `python -m lowvram_grpo.run` processes. In the argument lists `{tmp}` is a folder of
prepared bad files (see `bad_files`) and `{run}` an existing run directory."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.model.builtin_models import ensure_tiny_model
from lowvram_grpo.settings.config import SECTIONS, _TOP_LEVEL_SCALARS

# ---------------------------------------------------------------- CLI options: (id, argv, fragment of the error line)
CLI_CASES = [
    ("preset-unknown", ["--preset", "nope"], "unknown preset 'nope'"),
    ("preset-invalid-yaml", ["--preset", "{tmp}/broken.yaml"], "is not valid YAML"),
    ("preset-not-a-mapping", ["--preset", "{tmp}/list.yaml"], "must be a YAML mapping"),
    ("preset-unknown-section", ["--preset", "{tmp}/section.yaml"], "unknown section 'trainer'"),
    ("preset-unknown-key", ["--preset", "{tmp}/key.yaml"], "unknown key 'train.lr'"),
    ("list-presets-with-value", ["--list-presets=yes"], "ignored explicit argument"),
    ("set-without-equals", ["--preset", "tiny", "--set", "train.max_steps"], "--set expects section.key=value"),
    ("set-three-parts", ["--preset", "tiny", "--set", "train.a.b=1"], "--set key must be section.key"),
    ("set-unknown-section", ["--preset", "tiny", "--set", "trainer.max_steps=1"], "unknown section 'trainer'"),
    ("set-unknown-key", ["--preset", "tiny", "--set", "train.bogus=1"], "unknown key 'train.bogus'"),
    ("set-missing-value", ["--preset", "tiny", "--set"], "expected one argument"),
    ("max-steps-zero", ["--preset", "tiny", "--max-steps", "0"], "--max-steps: must be >= 1"),
    ("kv-fp8-on-a-t4", ["--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4", "--set", "model.kv_cache_dtype=fp8"],
     "model.kv_cache_dtype=fp8 needs compute capability >= 8.0 (unsloth_zoo refuses a float8 KV cache below) and "
     "Tesla T4 is sm75"),
    ("max-steps-word", ["--preset", "tiny", "--max-steps", "many"], "--max-steps: expected a whole number"),
    ("decode-int8-on-a-gpu", ["--preset", "qwen1_5b_4bit", "--dry-run", "--gpu", "t4", "--set", "decode.weights=int8"],
     "decode.weights=int8 quantizes the weights of our decode loop's fused layers (FBGEMM's CPU int8 linear) and this "
     "run is on CUDA (Tesla T4): set decode.weights=auto"),
    ("dataset-missing", ["--preset", "tiny", "--dataset", "{tmp}/missing.jsonl"], "does not exist"),
    ("dataset-empty", ["--preset", "tiny", "--dataset", "{tmp}/empty.jsonl"], "is empty"),
    ("dataset-no-columns", ["--preset", "tiny", "--dataset", "{tmp}/cols.jsonl"],
     "has no 'question' column and no TRL 'prompt' column: its columns are 'q', 'a'; map the question with "
     "data.question_column=NAME"),
    ("dataset-mapped-column-missing", ["--preset", "tiny", "--dataset", "{tmp}/cols.jsonl", "--set",
                                       "data.question_column=q",
                                       "--set", "data.answer_column=label"],
     "has no column 'label' (data.answer_column): its columns are 'q', 'a'"),
    ("dataset-bad-json", ["--preset", "tiny", "--dataset", "{tmp}/badjson.jsonl"], "is not valid JSON"),
    ("dataset-unknown-extension", ["--preset", "tiny", "--dataset", "{tmp}/data.xlsx"], "unknown extension '.xlsx'"),
    ("dataset-csv-wide-row", ["--preset", "tiny", "--dataset", "{tmp}/wide.csv"],
     "quote fields that contain the separator"),
    ("dataset-not-text", ["--preset", "tiny", "--dataset", "{tmp}/latin.csv"],
     "is neither UTF-8 nor Windows-1252 text"),
    ("dataset-empty-question", ["--preset", "tiny", "--dataset", "{tmp}/emptyq.jsonl"],
     "row 1 has an empty 'question'"),
    ("dataset-bad-prompt", ["--preset", "tiny", "--dataset", "{tmp}/badprompt.jsonl"],
     "'prompt' must be text or a list of chat messages"),
    ("dataset-mixed-prompts", ["--preset", "tiny", "--dataset", "{tmp}/mixedprompts.jsonl"],
     "mixes text prompts and chat-message prompts"),
    ("dataset-mixed-column", ["--preset", "tiny", "--dataset", "{tmp}/mixedtypes.jsonl"], "column 'level' of dataset"),
    ("dataset-trl-keyword-column", ["--preset", "tiny", "--dataset", "{tmp}/kwcolumn.jsonl"],
     "has a column 'trainer_state', a keyword TRL itself passes the reward functions"),
    ("dataset-no-gold-for-correctness", ["--preset", "tiny", "--dataset", "{tmp}/nogold.jsonl"],
     "reward 'correctness' needs gold answers and the data {tmp}/nogold.jsonl gives none (its other columns: "
     "'question'): map the answer column with data.answer_column=NAME"),
    ("validation-takes-every-training-question", ["--preset", "tiny", "--dataset", "{tmp}/dsfolder@main:train", "--set",
     "eval.every_steps=2", "--set", "eval.validation_size=6"],
     "eval.validation_size=6 validation questions leave 0 of the 6 training questions to train on: lower "
     "eval.validation_size, or set eval.every_steps=0 (no held-out curve)"),
    ("dataset-folder-bad-split", ["--preset", "tiny", "--dataset", "{tmp}/dsfolder@main:nope"], "cannot load dataset"),
    ("output-dir-under-a-file", ["--preset", "tiny", "--output-dir", "{tmp}/a_file/sub"], "cannot create output dir"),
    ("output-dir-is-a-file", ["--preset", "tiny", "--output-dir", "{tmp}/a_file"], "cannot create output dir"),
    ("output-dir-holds-a-finished-run", ["--preset", "tiny", "--output-dir", "{run}"],
     "output dir {run} holds a finished run (3 steps): train on from its adapter with: python -m lowvram_grpo.run "
     "--preset {run}/config.yaml --init-adapter {run}/adapter --output-dir {run}-more; or pick another --output-dir, "
     "or add --overwrite to replace it"),
    ("output-dir-holds-a-stopped-run", ["--preset", "tiny", "--output-dir", "{tmp}/started-run"],
     "holds a stopped run (no checkpoint yet): continue it with: "
     "python -m lowvram_grpo.run --resume {tmp}/started-run"),
    ("output-dir-being-written", ["--preset", "tiny", "--output-dir", "{tmp}/locked-run"],
     "output dir {tmp}/locked-run is being written by a running process (pid "),
    ("overwrite-a-running-run", ["--preset", "tiny", "--output-dir", "{tmp}/locked-run", "--overwrite"],
     "is being written by a running process (pid "),
    ("overwrite-with-value", ["--preset", "tiny", "--overwrite=yes"], "ignored explicit argument"),
    ("backend-unknown", ["--preset", "tiny", "--backend", "vllm"], "--backend: invalid choice"),
    ("resume-no-dir", ["--resume", "{tmp}/no-run"], "no such directory"),
    ("resume-not-a-run", ["--resume", "{tmp}"], "no config.yaml there"),
    ("resume-complete-run", ["--resume", "{run}"],
     "that run is complete (3 steps); to train on from its adapter: python -m lowvram_grpo.run --preset "
     "{run}/config.yaml --init-adapter {run}/adapter --output-dir {run}-more"),
    ("resume-a-running-run", ["--resume", "{tmp}/locked-run"], "that run is still running (pid "),
    ("resume-a-control-folder", ["--resume", "{tmp}/control-folder"],
     "that folder holds the random-reward control of {run}, not a run to continue; run the control again with: "
     "python -m lowvram_grpo.baseline {run} --control random-reward"),
    ("resume-with-preset", ["--resume", "{run}", "--preset", "tiny"], "drop --preset"),
    ("resume-with-set", ["--resume", "{run}", "--set", "train.max_steps=9"],
     "--resume --set train.max_steps: a resumed run keeps its training settings"),
    ("resume-with-bad-settable-value", ["--resume", "{tmp}/started-run", "--set", "eval.batch_size=0"],
     "eval.batch_size must be >= 1"),
    ("resume-with-output-dir", ["--resume", "{run}", "--output-dir", "{tmp}/elsewhere"], "drop --output-dir"),
    ("resume-with-overwrite", ["--resume", "{run}", "--overwrite"], "drop --overwrite"),
    ("resume-with-init-adapter", ["--resume", "{run}", "--init-adapter", "{run}/adapter"], "drop --init-adapter"),
    ("resume-missing-value", ["--resume"], "expected one argument"),
    ("resume-on-another-backend", ["--resume", "{tmp}/started-run", "--backend", "hf"],
     "started on the unsloth backend"),
    ("init-adapter-missing", ["--preset", "tiny", "--init-adapter", "{tmp}/no-adapter"],
     "lora.init_adapter: {tmp}/no-adapter does not exist: give the folder of a saved PEFT LoRA adapter"),
    ("init-adapter-a-run-folder", ["--preset", "tiny", "--init-adapter", "{run}"],
     "{run} holds a run, not an adapter: give its adapter, {run}/adapter"),
    ("init-adapter-not-lora", ["--preset", "tiny", "--init-adapter", "{tmp}/ia3-adapter"],
     "is a IA3 adapter: only LoRA adapters can be trained on here"),
    ("init-adapter-pattern-targets", ["--preset", "tiny", "--init-adapter", "{tmp}/pattern-adapter"],
     "names its target modules as '.*proj', not a list of layer names"),
    ("init-adapter-no-weights", ["--preset", "tiny", "--init-adapter", "{tmp}/weightless-adapter"], "has no weights"),
    ("init-adapter-truncated", ["--preset", "tiny", "--init-adapter", "{tmp}/truncated-adapter"],
     "has a damaged adapter_model.safetensors (truncated:"),
    ("init-adapter-other-base", ["--preset", "tiny", "--init-adapter", "{tmp}/smollm2-adapter"],
     "lora.init_adapter {tmp}/smollm2-adapter was trained on HuggingFaceTB/SmolLM2-135M-Instruct, not on model.name "
     "builtin:tiny"),
    ("init-adapter-missing-value", ["--preset", "tiny", "--init-adapter"], "expected one argument"),
    ("init-adapter-dora-merged", ["--preset", "tiny", "--init-adapter", "{tmp}/dora-adapter", "--set",
                                  "decode.merge_lora=true"],
     "lora.init_adapter {tmp}/dora-adapter sets use_dora in its adapter_config.json, which decode.merge_lora=true "
     "cannot merge (merged here: plain LoRA, rslora, alpha): set decode.merge_lora=auto and decode.fused=auto"),
    ("dry-run-with-value", ["--preset", "tiny", "--dry-run=yes"], "ignored explicit argument"),
    ("gpu-unknown-profile", ["--preset", "llama8b_4bit", "--dry-run", "--gpu", "gtx1080"],
     "unknown GPU profile 'gtx1080': choose one of t4"),
    ("gpu-without-dry-run", ["--preset", "tiny", "--gpu", "t4"], "--gpu t4 plans for a card you name: add --dry-run"),
    ("gpu-bf16-on-a-t4", ["--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4", "--set", "model.dtype=bfloat16"],
     "model.dtype=bfloat16 needs a GPU with native bf16"),
    ("vram-zero", ["--preset", "tiny", "--vram", "0"], "--vram: must be > 0"),
    ("vram-word", ["--preset", "tiny", "--vram", "big"], "--vram: expected a number of GiB"),
    ("auto-fit-without-a-card", ["--preset", "tiny", "--auto-fit"], "--auto-fit needs a card size"),
    ("export-unknown", ["--preset", "tiny", "--export", "zip"], "--export: invalid choice"),
    ("export-gguf-on-hf", ["--preset", "tiny", "--backend", "hf", "--export", "gguf"], "needs the unsloth backend"),
    ("debug-with-value", ["--preset", "tiny", "--debug=yes"], "ignored explicit argument"),
    ("gpu-preset-without-gpu", ["--preset", "llama8b_4bit"], "needs an NVIDIA GPU"),
    ("unknown-option", ["--preset", "tiny", "--lr", "1"], "unrecognized arguments: --lr"),
]

# ---------------------------------------------------------------- `lowvram-grpo doctor ARGS`
# (through the CLI's subcommand)
DOCTOR_CASES = [
    ("doctor-preset-unknown", ["--preset", "nope"], "unknown preset 'nope'"),
    ("doctor-preset-missing-value", ["--preset"], "expected one argument"),
    ("doctor-set-unknown-key", ["--preset", "tiny", "--set", "train.bogus=1"], "unknown key 'train.bogus'"),
    ("doctor-set-cannot-work-together", ["--preset", "tiny", "--set", "train.max_completion_length=400"],
     "do not fit model.max_seq_length (512)"),
    ("doctor-backend-unknown", ["--preset", "tiny", "--backend", "vllm"], "--backend: invalid choice"),
    ("doctor-output-dir-under-a-file", ["--preset", "tiny", "--quick", "--output-dir", "{tmp}/a_file/sub"],
     "(1) cannot create output dir {tmp}/a_file/sub: {tmp}/a_file is a file -> pass a writable --output-dir"),
    ("doctor-quick-with-value", ["--quick=yes"], "ignored explicit argument"),
    ("doctor-debug-with-value", ["--debug=yes"], "ignored explicit argument"),
    ("doctor-unknown-option", ["--preset", "tiny", "--lr", "1"], "unrecognized arguments: --lr"),
]

# ---------------------------------------------------------------- `python -m bench.gpu_first_run ARGS`
# (the first-run kit)
KIT_CASES = [
    ("kit-preset-missing", [], "the following arguments are required: --preset"),
    ("kit-preset-unknown", ["--preset", "nope"], "unknown preset 'nope'"),
    ("kit-preset-without-a-shape", ["--preset", "{tmp}/noshape.yaml"],
     "cannot plan for someone/unknown-7b: its config.json is not in the local hub cache"),
    ("kit-preset-family-without-a-stand-in", ["--preset", "gemma3_1b"],
     "the kit builds random stand-ins of the llama, mistral, qwen2, qwen3 families, not gemma3"),
    ("kit-variants-unknown", ["--preset", "tiny", "--variants", "fast"], "--variants: unknown variant 'fast'"),
    ("kit-variants-empty", ["--preset", "tiny", "--variants", ","], "--variants: name at least one variant"),
    ("kit-variant-not-installed", ["--preset", "tiny", "--variants", "hf-vllm"],
     "--variants: hf-vllm needs vllm, which is not installed"),
    ("kit-steps-one", ["--preset", "tiny", "--steps", "1"], "--steps: must be >= 2"),
    ("kit-steps-word", ["--preset", "tiny", "--steps", "few"], "--steps: expected a whole number"),
    ("kit-out-is-a-directory", ["--preset", "tiny", "--out", "{tmp}"], "--out {tmp} is a directory"),
    ("kit-out-under-a-file", ["--preset", "tiny", "--out", "{tmp}/a_file/r.json"],
     "{tmp}/a_file is not a writable folder"),
    ("kit-model-dir-is-a-file", ["--preset", "tiny", "--model-dir", "{tmp}/a_file"],
     "--model-dir {tmp}/a_file is a file"),
    ("kit-no-cap-with-value", ["--preset", "tiny", "--no-cap=yes"], "ignored explicit argument"),
    ("kit-budget-zero", ["--preset", "tiny", "--budget-s", "0"], "--budget-s: must be >= 1"),
    ("kit-budget-word", ["--preset", "tiny", "--budget-s", "long"], "--budget-s: expected a whole number"),
    ("kit-debug-with-value", ["--preset", "tiny", "--debug=yes"], "ignored explicit argument"),
    ("kit-unknown-option", ["--preset", "tiny", "--lr", "1"], "unrecognized arguments: --lr"),
]

# ---------------------------------------------------------------- config keys: (key, value, fragment), via --set
CONFIG_CASES = [
    ("train.shared_prompt", "sometimes", "train.shared_prompt must be one of"),
    ("train.adapter_check_every", "-1", "train.adapter_check_every must be >= 0"),
    ("train.adapter_guard_steps", "-2", "train.adapter_guard_steps must be >= 0"),
    ("model.name", "builtin:nope", "unknown built-in model 'builtin:nope'"),
    ("model.name", "./no/such/model", "model.name ./no/such/model does not exist"),
    ("model.name", "''", "model.name is empty"),
    ("model.max_seq_length", "8", "model.max_seq_length must be >= 16"),
    ("model.dtype", "fp8", "model.dtype must be one of"),
    ("model.fast_inference", "maybe", "model.fast_inference must be bool"),
    ("model.fast_inference", "true", "needs an NVIDIA GPU"),
    ("model.generation", "fast", "model.generation must be one of"),
    ("model.vllm_sync_steps", "0", "model.vllm_sync_steps must be >= 1"),
    ("lora.r", "0", "lora.r must be > 0"),
    ("lora.alpha", "-1", "lora.alpha must be > 0"),
    ("lora.dropout", "1.5", "lora.dropout must be in [0, 1)"),
    ("lora.target_modules", "[]", "lora.target_modules is empty"),
    ("lora.target_modules", "q_proj", "lora.target_modules must be a list of str"),
    ("lora.random_state", "abc", "lora.random_state must be int"),
    ("lora.init_adapter", "{tmp}/no-adapter", "lora.init_adapter: {tmp}/no-adapter does not exist"),
    ("train.learning_rate", "0", "train.learning_rate must be > 0"),
    ("train.adam_beta1", "1.5", "train.adam_beta1 must be in [0, 1)"),
    ("train.adam_beta2", "-0.1", "train.adam_beta2 must be in [0, 1)"),
    ("train.weight_decay", "-1", "train.weight_decay must be >= 0"),
    ("train.warmup_ratio", "1", "train.warmup_ratio must be in [0, 1)"),
    ("train.lr_scheduler_type", "exponential", "train.lr_scheduler_type must be one of"),
    ("train.optim", "sgd", "train.optim must be one of"),
    ("train.per_device_train_batch_size", "3", "must be divisible by train.num_generations"),
    ("train.per_device_train_batch_size", "0", "train.per_device_train_batch_size must be > 0 or null"),
    ("train.gradient_accumulation_steps", "0", "train.gradient_accumulation_steps must be >= 1"),
    ("train.num_generations", "1", "train.num_generations must be >= 2"),
    ("train.max_prompt_length", "0", "train.max_prompt_length must be >= 1"),
    ("train.max_completion_length", "0", "train.max_completion_length must be >= 1"),
    ("train.temperature", "0", "train.temperature must be > 0"),
    ("train.top_p", "0", "train.top_p must be in (0, 1]"),
    ("train.beta", "-0.1", "train.beta must be >= 0"),
    ("train.epsilon", "0", "train.epsilon must be > 0"),
    ("train.loss_type", "ppo",
     "train.loss_type must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo; got 'ppo'"),
    ("train.importance_sampling_level", "batch",
     "train.importance_sampling_level must be one of token, sequence; got 'batch'"),
    ("train.epsilon_high", "-0.1", "train.epsilon_high must be > 0 (DAPO: 0.28) or null"),
    ("train.top_entropy_quantile", "1.5", "train.top_entropy_quantile must be in (0, 1]"),
    ("train.dynamic_sampling", "maybe", "train.dynamic_sampling must be bool"),
    ("train.dynamic_sampling_max_draws", "0", "train.dynamic_sampling_max_draws must be >= 1"),
    ("train.dynamic_sampling_reward", "nope", "train.dynamic_sampling_reward must be one of the run's rewards.names "
     "(xmlcount, soft_format, strict_format, int, correctness, brevity) or null; got 'nope'"),
    ("train.scale_rewards", "std", "train.scale_rewards must be one of group, batch, none"),
    ("train.mask_truncated_completions", "maybe", "train.mask_truncated_completions must be bool"),
    ("train.max_grad_norm", "0", "train.max_grad_norm must be > 0"),
    ("train.max_steps", "0", "train.max_steps must be >= 1"),
    ("train.save_steps", "0", "train.save_steps must be >= 1"),
    ("train.keep_checkpoints", "0", "train.keep_checkpoints must be >= 1"),
    ("train.max_nonfinite_steps", "0", "train.max_nonfinite_steps must be >= 1"),
    ("train.logging_steps", "0", "train.logging_steps must be >= 1"),
    ("train.report_to", "tensorbored", "train.report_to must be one of none, tensorboard"),
    ("train.report_to", "none,wandb", "train.report_to lists none with other trackers"),
    ("train.report_to", "trackio", "train.report_to=trackio needs trackio: pip install trackio"),
    ("train.seed", "abc", "train.seed must be int"),
    ("data.dataset", "{tmp}/missing.jsonl", "does not exist"),
    ("data.system_prompt", "[a, b]", "data.system_prompt must be str"),
    ("data.answer_format", "json", "data.answer_format must be one of xml, think; got 'json'"),
    ("data.answer_format", "think", "rewards.names xmlcount, soft_format, strict_format, int, correctness score "
                                    "another answer format than data.answer_format=think: name think's own instead, "
                                    "e.g. --set rewards.names=[think_format,think_correctness]"),
    ("data.chat_template_kwargs", "{tokenize: true}", "data.chat_template_kwargs.tokenize is an argument of "
                                                      "apply_chat_template itself"),
    ("data.chat_template_kwargs", "enable_thinking",
     "data.chat_template_kwargs must be a mapping, e.g. {enable_thinking: false}"),
    ("data.chat_template_kwargs", "{enable_thinking: [1]}",
     "data.chat_template_kwargs.enable_thinking must be a bool, number or string"),
    ("data.question_column", "''", "data.question_column is empty"),
    ("data.answer_column", "[a]", "data.answer_column must be str"),
    ("data.solution_column", "' '", "data.solution_column is empty"),
    ("data.num_train", "0", "data.num_train must be >= 1 or null"),
    ("data.eval_size", "0", "data.eval_size must be >= 1"),
    ("data.eval_dataset", "{tmp}/missing.jsonl", "does not exist"),
    ("data.max_operand", "1", "data.max_operand must be >= 2"),
    ("data.seed", "1.5", "data.seed must be int"),
    ("rewards.names", "[]", "rewards.names is empty"),
    ("rewards.names", "[nope]", "unknown reward 'nope' in rewards.names"),
    ("rewards.names", "[int, int]", "rewards.names lists a reward twice"),
    ("rewards.weights", "[1, 2]", "rewards.weights has 2 values for 6 names"),
    ("rewards.weights", "[a, b, c, d, e, f]", "rewards.weights[0] must be float"),
    ("rewards.module", "{tmp}/missing.py", "rewards.module {tmp}/missing.py does not exist"),
    ("rewards.module", "{tmp}/rewards.txt", "rewards.module must be a .py file"),
    ("rewards.module", "{tmp}/syntax.py", "failed to import: SyntaxError"),
    ("rewards.module", "{tmp}/importerr.py", "failed to import: ModuleNotFoundError"),
    ("rewards.on_error", "ignore", "rewards.on_error must be one of stop, zero"),
    ("tools.names", "[calculator, calculator]", "tools.names lists a tool twice"),
    ("tools.names", "[nope]",
     "unknown tool 'nope' in tools.names: choose from calculator (or give your own in tools.module)"),
    ("tools.module", "{tmp}/tools_good.py", "tools.module is set but tools.names is empty"),
    ("tools.max_turns", "0", "tools.max_turns must be >= 1"),
    ("tools.timeout_seconds", "0", "tools.timeout_seconds must be > 0"),
    ("tools.max_tokens_per_turn", "0", "tools.max_tokens_per_turn must be >= 1"),
    ("environment.name", "Shop", "environment.module and environment.name go together"),
    ("environment.module", "{tmp}/tools_good.py", "environment.module and environment.name go together"),
    ("prime.steps", "-1", "prime.steps must be >= 0"),
    ("prime.learning_rate", "0", "prime.learning_rate must be > 0"),
    ("prime.batch_size", "0", "prime.batch_size must be >= 1"),
    ("prime.save_steps", "-1", "prime.save_steps must be >= 0"),
    ("eval.temperature", "-1", "eval.temperature must be >= 0"),
    ("eval.top_p", "2", "eval.top_p must be in (0, 1]"),
    ("eval.seed", "x", "eval.seed must be int"),
    ("eval.batch_size", "0", "eval.batch_size must be >= 1"),
    ("eval.samples", "-1", "eval.samples must be >= 0"),
    ("eval.sample_temperature", "0", "eval.sample_temperature must be > 0"),
    ("eval.enabled", "maybe", "eval.enabled must be bool"),
    ("eval.every_steps", "-1", "eval.every_steps must be >= 0 (0 = off) or null (auto)"),
    ("eval.validation_size", "0", "eval.validation_size must be >= 1"),
    ("log.completions_every", "-1", "log.completions_every must be >= 0"),
    ("log.completions_groups", "0", "log.completions_groups must be >= 1"),
    ("log.completions_max_mb", "0", "log.completions_max_mb must be > 0"),
    ("memory.load_in_4bit", "maybe", "memory.load_in_4bit must be bool"),
    ("memory.gpu_memory_utilization", "0.99", "memory.gpu_memory_utilization must be in [0.05, 0.95]"),
    ("memory.gradient_checkpointing", "sometimes", "memory.gradient_checkpointing must be one of"),
    ("memory.vram_gb", "0", "memory.vram_gb must be > 0 or null"),
    ("memory.vllm_kv_cache_gb", "0", "memory.vllm_kv_cache_gb must be > 0 or null"),
    ("memory.vllm_cpu_threads", "0", "memory.vllm_cpu_threads must be >= 1 or null"),
    ("memory.host_allocator", "jemalloc", "memory.host_allocator must be one of"),
    ("decode.loop", "fast", "decode.loop must be one of"),
    ("decode.sampler", "gumbel", "decode.sampler must be one of"),
    ("decode.merge_lora", "always", "decode.merge_lora must be one of"),
    ("decode.fused", "maybe", "decode.fused must be one of"),
    ("decode.weights", "int4", "decode.weights must be one of auto, bf16, int8; got 'int4'"),
    ("train.is_correction", "maybe", "train.is_correction must be one of auto, on, off; got 'maybe'"),
    ("train.is_logprobs", "nograd", "train.is_logprobs must be one of auto, loss, forward; got 'nograd'"),
    ("model.kv_cache_dtype", "int4", "model.kv_cache_dtype must be one of auto, fp8, bfloat16, float16, float32"),
]

# ---------------------------------------------------------------- a user's reward file: (id, extra --set values,
# fragment)
REWARD_FILE_CASES = [
    ("name-not-in-file", ["rewards.module={tmp}/good.py", "rewards.names=[says_four, nope]"],
     "unknown reward 'nope' in rewards.names: choose from"),
    ("not-callable", ["rewards.module={tmp}/notcallable.py", "rewards.names=[score]"], "'score' in rewards.module"),
    ("probe-wrong-length", ["rewards.module={tmp}/wronglen.py", "rewards.names=[wrong_len]"],
     "reward 'wrong_len' returned 2 scores for 1 completions: return one number per completion (called once on the "
     "first training row, as TRL will call it)"),
    ("probe-raises", ["rewards.module={tmp}/raises.py", "rewards.names=[raises]"],
     "reward 'raises' raised ValueError: boom"),
    ("probe-complex", ["rewards.module={tmp}/complexscore.py", "rewards.names=[complex_score]"],
     "reward 'complex_score' returned 1j (complex) as score 0"),
    ("probe-not-numbers", ["rewards.module={tmp}/text.py", "rewards.names=[text_score]"],
     "returned 'good' (str) as score 0"),
    ("probe-no-kwargs", ["rewards.module={tmp}/nokwargs.py", "rewards.names=[no_kwargs]"],
     "reward 'no_kwargs' does not take the keyword 'answer' that TRL passes it"),
    ("probe-async-raises", ["rewards.module={tmp}/asyncraises.py", "rewards.names=[async_raises]"],
     "reward 'async_raises' raised RuntimeError: judge down"),
    ("reward-model-missing", ["rewards.names=[correctness, {tmp}/no-reward-model]"],
     "reward model '{tmp}/no-reward-model' in rewards.names: no model folder (config.json) there"),
    ("shadows-a-built-in", ["rewards.module={tmp}/shadow.py", "rewards.names=[correctness]"],
     "defines 'correctness', the name of a built-in reward"),
]

# ---------------------------------------------------------------- a user's tools file: (id, extra --set values,
# fragment)
TOOL_FILE_CASES = [
    ("module-missing", ["tools.module={tmp}/missing_tools.py", "tools.names=[lookup]"],
     "tools.module {tmp}/missing_tools.py does not exist: give the path of a .py file"),
    ("module-not-python", ["tools.module={tmp}/rewards.txt", "tools.names=[lookup]"],
     "tools.module must be a .py file"),
    ("module-syntax-error", ["tools.module={tmp}/syntax.py", "tools.names=[lookup]"],
     "tools.module {tmp}/syntax.py failed to import: SyntaxError"),
    ("name-not-in-file", ["tools.module={tmp}/tools_good.py", "tools.names=[lookup, nope]"],
     "unknown tool 'nope' in tools.names: choose from calculator; {tmp}/tools_good.py defines: lookup, no_args, "
     "no_hint, undocumented"),
    ("undocumented", ["tools.module={tmp}/tools_good.py", "tools.names=[undocumented]"],
     "tool 'undocumented' in tools.module {tmp}/tools_good.py has no docstring"),
    ("no-type-hint", ["tools.module={tmp}/tools_good.py", "tools.names=[no_hint]"],
     "tool 'no_hint' in tools.module {tmp}/tools_good.py: parameter 'word' has no type hint"),
    ("no-args-section", ["tools.module={tmp}/tools_good.py", "tools.names=[no_args]"],
     "tool 'no_args' cannot be shown to the model as a JSON schema (transformers' get_json_schema: Cannot generate "
     "JSON schema for no_args because the docstring has no description for the argument 'word')"),
    ("not-a-function", ["tools.module={tmp}/notcallable.py", "tools.names=[score]"],
     "tool 'score' in tools.module {tmp}/notcallable.py is a int, not a function defined with def"),
    ("shadows-a-built-in", ["tools.module={tmp}/tools_shadow.py", "tools.names=[calculator]"],
     "defines 'calculator', the name of a built-in tool: rename it"),
    ("one-function-two-names", ["tools.module={tmp}/tools_alias.py", "tools.names=[lookup, find]"],
     "tools.names: 'lookup' and 'find' are both the function 'lookup'"),
    ("text-prompts", ["tools.names=[calculator]", "data.dataset={tmp}/textprompts.jsonl"],
     "tools need chat-message prompts, and the data {tmp}/textprompts.jsonl has text prompts"),
]

TOOLS_GOOD = '''def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: The word.
    """
    return word


def undocumented(word: str) -> str:
    return word


def no_hint(word):
    """Echo.

    Args:
        word: The word.
    """
    return word


def no_args(word: str) -> str:
    """Echo a word."""
    return word
'''
TOOLS_ALIAS = TOOLS_GOOD.split("\n\n\ndef undocumented")[0] + "\n\n\nfind = lookup\n"
TOOLS_SHADOW = 'def calculator(expression: str) -> str:\n    """Mine.\n\n    Args:\n        expression: x\n    """\n'

# ---------------------------------------------------------------- top-level preset keys, via a preset file:
# (id, YAML, fragment)
TOP_LEVEL_CASES = [
    ("preset", "preset: [a]\nmodel: {name: builtin:tiny}\n", "preset must be str"),
    ("description", "description: {a: 1}\nmodel: {name: builtin:tiny}\n", "description must be str"),
    ("requires_cuda", "requires_cuda: maybe\nmodel: {name: builtin:tiny}\n", "requires_cuda must be bool"),
    ("requires_cuda-without-gpu", "requires_cuda: true\nmodel: {name: builtin:tiny}\n", "needs an NVIDIA GPU"),
    ("section-not-a-mapping", "train: 5\n", "section 'train' must be a mapping"),
]

FILES = {
    "broken.yaml": "model: [unclosed\n",
    "list.yaml": "- a\n- b\n",
    "section.yaml": "trainer: {max_steps: 1}\n",
    "key.yaml": "train: {lr: 1}\n",
    "empty.jsonl": "",
    "cols.jsonl": '{"q": "a", "a": "b"}\n' * 40,
    "badjson.jsonl": '{"question": "1 + 1?", "answer": "#### 2"}\n{oops\n',
    "data.xlsx": "question,answer\n",
    "wide.csv": "question,answer\nWhat is 1, 2?,3,4\n",
    "emptyq.jsonl": '{"question": " ", "answer": "1"}\n' * 10,
    "badprompt.jsonl": '{"prompt": {"text": "hi"}}\n' * 10,
    "mixedprompts.jsonl": '{"prompt": "hi"}\n{"prompt": [{"role": "user", "content": "hi"}]}\n' * 5,
    "mixedtypes.jsonl": ('{"question": "a", "answer": "1", "level": 3}\n'
                         '{"question": "b", "answer": "2", "level": "hard"}\n') * 5,
    "kwcolumn.jsonl": '{"question": "a", "answer": "1", "trainer_state": "x"}\n' * 10,
    "nogold.jsonl": '{"question": "Name a colour."}\n' * 10,
    "dsfolder/README.md": ("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                           "    path: main.jsonl\n---\n"),
    "dsfolder/main.jsonl": '{"question": "1 + 1?", "answer": "#### 2"}\n' * 10,
    "complexscore.py": "def complex_score(prompts, completions, **kwargs):\n    return [1j] * len(completions)\n",
    "nokwargs.py": "def no_kwargs(prompts, completions):\n    return [0.0] * len(completions)\n",
    "asyncraises.py": "async def async_raises(prompts, completions, **kwargs):\n    raise RuntimeError('judge down')\n",
    "a_file": "x",
    "rewards.txt": "not python",
    "syntax.py": "def broken(:\n",
    "importerr.py": "import not_a_module_anywhere_xyz\n",
    "good.py": "def says_four(prompts, completions, **kwargs):\n    return [1.0 for _ in completions]\n",
    "notcallable.py": "score = 3\n",
    "wronglen.py": "def wrong_len(prompts, completions, **kwargs):\n    return [1.0] * (len(completions) + 1)\n",
    "raises.py": "def raises(prompts, completions, **kwargs):\n    raise ValueError('boom')\n",
    "text.py": "def text_score(prompts, completions, **kwargs):\n    return ['good'] * len(completions)\n",
    "shadow.py": "def correctness(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n",
    "small.jsonl": '{"question": "1 + 1?", "answer": "#### 2"}\n' * 10,
    "noshape.yaml": "model: {name: someone/unknown-7b}\n",
    "tools_good.py": TOOLS_GOOD,
    "tools_shadow.py": TOOLS_SHADOW,
    "tools_alias.py": TOOLS_ALIAS,
    "textprompts.jsonl": '{"prompt": "What is 2 + 2?", "answer": "4"}\n' * 10,
}

# ---------------------------------------------------------------- settings that cannot work together (checks.py):
# (class, extra argv after --preset tiny, fragment). Each is refused before training with exit 2, nothing written;
# the '-after-load' ones need the loaded model (a tiny GPT-2, whose layers are not Llama's) and are refused
# right after it loads.
CROSS_CASES = [
    ("lengths", ["--set", "train.max_completion_length=400"],
     "= 656 tokens do not fit model.max_seq_length (512): set model.max_seq_length=656"),
    ("context", ["--set", "model.max_seq_length=4096"], "longer than builtin:tiny's context of 2048 tokens"),
    ("lora-target", ["--set", "lora.target_modules=[q_proj, qkv_proj]"],
     "has no 'qkv_proj'; its linear layers are down_proj"),
    ("lora-rank", ["--set", "lora.r=64"], "lora.r=64 exceeds the smaller side of k_proj (64 x 32)"),
    ("held-out", ["--dataset", "{tmp}/small.jsonl", "--set", "data.eval_size=50"],
     "too few to hold out data.eval_size=50"),
    ("lora-target-after-load", ["--set", "model.name={tmp}/gpt2-tiny"], "has no 'q_proj', 'k_proj'"),
    ("lora-rank-after-load", ["--set", "model.name={tmp}/gpt2-tiny", "--set", "lora.target_modules=[c_attn, c_fc]",
                              "--set", "lora.r=64"], "lora.r=64 exceeds the smaller side of c_attn (32 x 96)"),
    ("context-after-load", ["--set", "model.name={tmp}/gpt2-tiny", "--set", "lora.target_modules=[c_attn]",
                            "--set", "model.max_seq_length=1024"],
     "model.max_seq_length=1024 is longer than {tmp}/gpt2-tiny's context of 512 tokens"),
    ("turn-cap-above-budget", ["--set", "tools.names=[calculator]", "--set", "tools.max_tokens_per_turn=999"],
     "tools.max_tokens_per_turn=999 is above train.max_completion_length="),
    ("dynamic-sampling-reward-alone", ["--set", "train.dynamic_sampling_reward=correctness"],
     "train.dynamic_sampling_reward=correctness does nothing without dynamic sampling: "
     "add --set train.dynamic_sampling=true"),
    ("kv-fp8-without-vllm", ["--set", "model.kv_cache_dtype=fp8"],
     "model.kv_cache_dtype=fp8 is unsloth's vLLM engine's fp8 KV cache and this run generates with transformers"),
    ("kv-dtype-not-compute", ["--set", "model.kv_cache_dtype=float16"], "the KV cache is kept in the compute dtype"),
    ("is-logprobs-loss-uncorrected", ["--set", "train.is_logprobs=loss", "--set", "train.is_correction=off"],
     "train.is_logprobs=loss takes the correction's trainer log-probs from TRL's loss, and the importance-sampling "
     "correction is off in this run (train.is_correction): set train.is_logprobs=auto"),
    ("environment", ["--set", "environment.module={tmp}/no_env.py", "--set", "environment.name=Shop"],
     "environment.module {tmp}/no_env.py does not exist"),
    # the '-before-load' ones need only the tokenizer: their models have no weights, so a check that came after
    # the model loads would end in a loading error instead
    ("tools-template-before-load", ["--set", "model.name={tmp}/gpt2-plain-chat-no-weights",
                                    "--set", "lora.target_modules=[c_attn]", "--set", "tools.names=[calculator]"],
     "{tmp}/gpt2-plain-chat-no-weights's chat template cannot render tool calls"),
    ("chat-template-before-load", ["--set", "model.name={tmp}/tiny-no-template-no-weights"],
     "{tmp}/tiny-no-template-no-weights's tokenizer has no chat template and the prompts are chat messages: use the "
     "model's instruct (chat) version"),
    ("template-kwargs-before-load", ["--set", "model.name={tmp}/tiny-no-weights",
                                     "--set", "data.chat_template_kwargs={enable_thinking: false}"],
     "data.chat_template_kwargs enable_thinking: {tmp}/tiny-no-weights's chat template never reads it"),
    ("prompt-length-before-load", ["--set", "model.name={tmp}/tiny-no-weights", "--set", "tools.names=[calculator]"],
     "every training prompt is longer than train.max_prompt_length=256 tokens (with the tools' schemas, which TRL "
     "renders into every prompt); the shortest is"),  # the schema makes every tiny prompt too long
]
CHECK_CLASSES = {"lengths", "context", "lora-target", "lora-rank", "held-out", "environment", "tools-template",
                 "prompt-length", "chat-template", "template-kwargs"}


def _drop_chat_template(folder) -> None:
    """The tokenizer files of `folder` without a chat template (as a base model's are)."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    for name, text in FILES.items():
        (tmp / name).parent.mkdir(exist_ok=True)
        (tmp / name).write_text(text)
    (tmp / "latin.csv").write_bytes(b"question,answer\n\x81\x8d,1\n")  # neither UTF-8 nor Windows-1252
    for case_id, text, _ in TOP_LEVEL_CASES:
        (tmp / f"top-{case_id}.yaml").write_text(text)
    _tiny_gpt2(tmp / "gpt2-tiny")
    _tiny_gpt2(tmp / "gpt2-plain-chat-no-weights", chat_template=PLAIN_CHATML)  # a chat template that renders no tools
    shutil.copytree(ensure_tiny_model(), tmp / "tiny-no-weights")
    shutil.copytree(ensure_tiny_model(), tmp / "tiny-no-template-no-weights")  # a base model's tokenizer: no template
    _drop_chat_template(tmp / "tiny-no-template-no-weights")
    for folder in ("gpt2-plain-chat-no-weights", "tiny-no-weights",
                   "tiny-no-template-no-weights"):  # tokenizer + config.json
        (tmp / folder / "model.safetensors").unlink()
    run = tmp / "complete-run"  # what a finished run leaves (for --resume)
    run.mkdir()
    (run / "config.yaml").write_text("preset: tiny\nmodel: {name: builtin:tiny}\n")
    (run / "summary.json").write_text(json.dumps({"status": "complete", "steps": 3}))
    started = tmp / "started-run"  # a run killed while training on the unsloth backend
    started.mkdir()
    (started / "config.yaml").write_text("preset: tiny\nmodel: {name: builtin:tiny}\n")
    (started / "summary.json").write_text(json.dumps({"status": "training", "backend": "unsloth"}))
    _adapters(tmp, run / "adapter")
    control = tmp / "control-folder"  # a random-reward control stopped mid-way (baseline.py)
    control.mkdir()
    (control / "config.yaml").write_text("preset: tiny\nmodel: {name: builtin:tiny}\n")
    (control / "summary.json").write_text(json.dumps({"status": "training", "control": "random-reward",
                                                      "of_run": str(run), "backend": "hf"}))
    locked = tmp / "locked-run"  # a run another process is writing right now
    locked.mkdir()
    (locked / "config.yaml").write_text("preset: tiny\nmodel: {name: builtin:tiny}\n")
    (locked / "summary.json").write_text(json.dumps({"status": "training", "backend": "hf"}))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(locked)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    assert holder.stdout.readline().strip() == "locked"
    yield tmp
    holder.kill()
    holder.wait()


# Holds a run folder's lock, as a running run does, until killed.
HOLD_LOCK = ("import sys, time; from lowvram_grpo.report.run_dir import RunDir; RunDir(sys.argv[1]).lock(); "
             "print('locked', flush=True); time.sleep(3600)")


def _adapters(tmp, ours):
    """A real LoRA adapter of the tiny model (a finished run's), and copies of it another tool could have
    written: for another base model, of another PEFT type, with a pattern for targets, DoRA, without weights."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(ours)
    for name, change in (("smollm2-adapter", {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}),
                         ("ia3-adapter", {"peft_type": "IA3"}), ("pattern-adapter", {"target_modules": ".*proj"}),
                         ("dora-adapter", {"use_dora": True}),
                         ("weightless-adapter", {}), ("truncated-adapter", {})):
        shutil.copytree(ours, tmp / name)
        config = json.loads((ours / "adapter_config.json").read_text())
        (tmp / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (tmp / "weightless-adapter" / "adapter_model.safetensors").unlink()
    weights = tmp / "truncated-adapter" / "adapter_model.safetensors"  # a copy cut short, as an interrupted download
    os.truncate(weights, weights.stat().st_size // 2)


# Plain ChatML, the tiny model's chat template before it rendered tools.
PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tiny_gpt2(folder, chat_template=None):
    """A 2-layer GPT-2 (Conv1D c_attn/c_fc layers, no q_proj) with the tiny model's tokenizer: its layer
    names are only known once it is loaded. Context 512 tokens (its config.json calls it n_positions).
    `chat_template`: one instead of the tiny model's (and no response template)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from lowvram_grpo.model.builtin_models import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    if chat_template is not None:
        tokenizer.chat_template, tokenizer.response_template = chat_template, None
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=512, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _fill(args, tmp):
    return [a.replace("{tmp}", str(tmp)).replace("{run}", str(tmp / "complete-run")) for a in args]


def _snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def _main(argv, capsys, main=None):
    if main is None:
        from lowvram_grpo.run.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err


def _assert_refused(code, stderr, fragment):
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert fragment in errors[0], errors[0]


def _check_case(argv, fragment, tmp, capsys, main=None):
    argv = _fill(argv, tmp)
    out = tmp / "out-never"
    if main is None and "--output-dir" not in argv and "--resume" not in argv:
        argv += ["--output-dir", str(out)]
    before = _snapshot(tmp)
    code, stderr = _main(argv, capsys, main)
    _assert_refused(code, stderr, _fill([fragment], tmp)[0])
    assert not out.exists() and _snapshot(tmp) == before, "a refused run must write nothing"


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_cli_option(argv, fragment, bad_files, capsys):
    _check_case(argv, fragment, bad_files, capsys)


@pytest.mark.parametrize("key, value, fragment", CONFIG_CASES, ids=[f"{k}={v}" for k, v, _ in CONFIG_CASES])
def test_bad_config_value(key, value, fragment, bad_files, capsys):
    _check_case(["--preset", "tiny", "--set", f"{key}={value}"], fragment, bad_files, capsys)


@pytest.mark.parametrize("sets, fragment", [c[1:] for c in REWARD_FILE_CASES], ids=[c[0] for c in REWARD_FILE_CASES])
def test_bad_reward_file(sets, fragment, bad_files, capsys):
    argv = ["--preset", "tiny"] + [part for s in sets for part in ("--set", s)]
    _check_case(argv, fragment, bad_files, capsys)


@pytest.mark.parametrize("sets, fragment", [c[1:] for c in TOOL_FILE_CASES], ids=[c[0] for c in TOOL_FILE_CASES])
def test_bad_tools_file(sets, fragment, bad_files, capsys):
    argv = ["--preset", "tiny"] + [part for s in sets for part in ("--set", s)]
    _check_case(argv, fragment, bad_files, capsys)


@pytest.mark.parametrize("case_id, fragment", [(c[0], c[2]) for c in TOP_LEVEL_CASES],
                         ids=[c[0] for c in TOP_LEVEL_CASES])
def test_bad_top_level_preset_value(case_id, fragment, bad_files, capsys):
    _check_case(["--preset", f"{{tmp}}/top-{case_id}.yaml"], fragment, bad_files, capsys)


@pytest.mark.parametrize("extra, fragment", [c[1:] for c in CROSS_CASES], ids=[c[0] for c in CROSS_CASES])
def test_settings_that_cannot_work_together(extra, fragment, bad_files, capsys):
    _check_case(["--preset", "tiny", *extra], fragment, bad_files, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("argv, fragment", [c[1:] for c in DOCTOR_CASES], ids=[c[0] for c in DOCTOR_CASES])
def test_bad_doctor_argument(argv, fragment, bad_files, capsys):
    _check_case(["doctor", *argv], fragment, bad_files, capsys)


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in KIT_CASES], ids=[c[0] for c in KIT_CASES])
def test_bad_first_run_kit_argument(argv, fragment, bad_files, capsys):
    import importlib.util

    from bench.gpu_first_run import main as kit_main

    if "hf-vllm" in argv and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the hf-vllm variant is available")
    _check_case(argv, fragment, bad_files, capsys, main=kit_main)


def _float_keys():
    """Every config key that holds floats (float, Optional[float], list[float]), from the dataclasses."""
    import typing

    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if float in (hint, *typing.get_args(hint)) or hint == list[float] or list[float] in typing.get_args(hint):
                yield f"{section}.{f.name}", hint


@pytest.mark.parametrize("written", [".inf", "-.inf", ".nan", "nan", "1e999"])
@pytest.mark.parametrize("key", [k for k, _ in _float_keys()])
def test_no_float_setting_takes_a_non_finite_value(key, written, bad_files, capsys):
    listy = key == "rewards.weights"
    value = f"[1, 1, 1, 1, 1, {written}]" if listy else written
    where = "rewards.weights[5]" if listy else key
    _check_case(["--preset", "tiny", "--set", f"{key}={value}"], f"{where} must be a finite number", bad_files, capsys)


def test_every_check_class_has_a_case():
    assert CHECK_CLASSES <= {c[0].removesuffix("-after-load").removesuffix("-before-load") for c in CROSS_CASES}
    assert len(list(_float_keys())) >= 15  # the non-finite sweep covers every float key it finds


def test_legal_but_surprising_settings_warn_once():
    from lowvram_grpo.settings.checks import surprises
    from lowvram_grpo.settings.config import load_config

    quiet = load_config("smollm2_cpu")
    assert surprises(quiet, 2000) == []
    long_eval = load_config("tiny", ["data.eval_size=200", "train.max_steps=1", "prime.steps=2"])
    (line,) = surprises(long_eval, 200)
    assert line.startswith("warning: evaluation samples 600 completions") and "lower data.eval_size" in line
    (line,) = surprises(load_config("tiny", ["data.num_train=5000"]), 3000)
    assert "data.num_train=5000 but the data has 3000 training rows" in line


def test_every_cli_option_has_a_case():
    from lowvram_grpo.run.cli import build_parser

    options = {s for action in build_parser()._actions for s in action.option_strings} - {"-h", "--help"}
    covered = {arg.split("=")[0] for _, argv, _ in CLI_CASES for arg in argv if arg.startswith("--")}
    assert options - covered == set(), "add a bad-value case to CLI_CASES"


def test_every_doctor_and_kit_option_has_a_case():
    from bench.gpu_first_run import build_parser as kit_parser
    from lowvram_grpo.doctor import build_parser as doctor_parser

    for parser, cases in ((doctor_parser(), DOCTOR_CASES), (kit_parser(), KIT_CASES)):
        options = {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}
        covered = {arg.split("=")[0] for _, argv, _ in cases for arg in argv if arg.startswith("--")}
        assert options - covered == set(), f"add a bad-value case for {parser.prog}"


def test_every_config_key_has_a_case():
    keys = {f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert keys - {key for key, _, _ in CONFIG_CASES} == set(), "add a bad-value case to CONFIG_CASES"
    assert set(_TOP_LEVEL_SCALARS) - {c[0] for c in TOP_LEVEL_CASES} == set(), "add a case to TOP_LEVEL_CASES"


IN_A_FRESH_PROCESS = ["max-steps-word", "set-unknown-key", "resume-complete-run", "gpu-preset-without-gpu",
                      "output-dir-holds-a-finished-run", "output-dir-being-written", "dataset-no-gold-for-correctness"]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", IN_A_FRESH_PROCESS)
def test_in_a_fresh_process(case_id, bad_files):
    _, argv, fragment = next(c for c in CLI_CASES if c[0] == case_id)
    argv = _fill(argv, bad_files)
    out = bad_files / "out-never"
    proc = run_cli(*argv, *([] if "--resume" in argv or "--output-dir" in argv else ["--output-dir", str(out)]),
                   timeout=120)
    _assert_refused(proc.returncode, proc.stderr, _fill([fragment], bad_files)[0])
    assert not out.exists()


def test_a_mismatched_or_corrupt_adapter_is_refused_by_load_lora(tmp_path, tiny_model_dir):
    """An adapter trained on a base with another hidden size, or a damaged one, is an AdapterError
    that says so (test_training covers the incomplete and missing ones on a trained handle)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.model.lora_io import AdapterError

    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    get_peft_model(other, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")).save_pretrained(
        tmp_path / "other")
    handle = load_model(resolve(load_config("tiny"), detect(), "hf"))
    with pytest.raises(AdapterError, match=r"does not fit this base model \(it was made for .*\): .*size mismatch"):
        handle.load_lora(tmp_path / "other")
    handle.save_lora(tmp_path / "mine")
    weights = tmp_path / "mine" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as a full disk would leave it
    with pytest.raises(AdapterError, match="corrupt adapter_model.safetensors"):
        handle.load_lora(tmp_path / "mine")


# ---------------------------------------------------------------- `lowvram-grpo eval` (evaluate.py):
# (id, argv after 'eval', fragment)
# Refused before the model loads; the command writes nothing in any case. `{tmp}/adapter-*` are prepared adapters.
EVAL_CASES = [
    ("adapter-missing", ["--adapter", "{tmp}/no-adapter"], "--adapter {tmp}/no-adapter: no adapter at"),
    ("adapter-incomplete", ["--adapter", "{tmp}/adapter-incomplete"],
     "is incomplete: adapter_model.safetensors missing"),
    ("adapter-other-base", ["--preset", "tiny", "--adapter", "{tmp}/adapter-other"],
     "was made for someone/Other-Model-7B, not for the model here (builtin:tiny): pass --model someone/Other-Model-7B"),
    ("adapter-same-names", ["--preset", "tiny", "--adapter", "a={tmp}/adapter-tiny", "--adapter",
                            "a={tmp}/adapter-tiny"],
     "two columns have the same name"),
    ("adapter-missing-value", ["--adapter"], "expected one argument"),
    ("dataset-missing", ["--preset", "tiny", "--dataset", "{tmp}/missing.jsonl"], "does not exist"),
    ("dataset-no-columns", ["--preset", "tiny", "--dataset", "{tmp}/cols.jsonl"],
     "has no 'question' column and no TRL 'prompt' column"),
    ("limit-zero", ["--preset", "tiny", "--limit", "0"], "--limit: must be >= 1"),
    ("limit-word", ["--preset", "tiny", "--limit", "all"], "--limit: expected a whole number"),
    ("preset-unknown", ["--preset", "nope"], "unknown preset 'nope'"),
    ("model-missing", ["--preset", "tiny", "--model", "./no/such/model"], "model.name ./no/such/model does not exist"),
    ("set-unknown-key", ["--preset", "tiny", "--set", "eval.bogus=1"], "unknown key 'eval.bogus'"),
    ("set-bad-value", ["--preset", "tiny", "--set", "eval.samples=-2"], "eval.samples must be >= 0"),
    ("without-tools-no-tools", ["--preset", "tiny", "--without-tools"],
     "--without-tools: these settings have no tools"),
    ("backend-unknown", ["--preset", "tiny", "--backend", "vllm"], "--backend: invalid choice"),
    ("gpu-preset-without-gpu", ["--preset", "llama8b_4bit", "--dataset", "{tmp}/small.jsonl"], "needs an NVIDIA GPU"),
    ("json-with-value", ["--preset", "tiny", "--json=yes"], "ignored explicit argument"),
    ("debug-with-value", ["--preset", "tiny", "--debug=yes"], "ignored explicit argument"),
    ("unknown-option", ["--preset", "tiny", "--output-dir", "x"], "unrecognized arguments: --output-dir"),
]


@pytest.fixture(scope="module")
def eval_files(bad_files):
    """Adapters for the eval cases: a complete one of builtin:tiny, one made for another model, one incomplete."""
    import torch
    from safetensors.torch import save_file

    for name, base in (("adapter-tiny", "builtin:tiny"), ("adapter-other", "someone/Other-Model-7B"),
                       ("adapter-incomplete", "builtin:tiny")):
        folder = bad_files / name
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
        if name != "adapter-incomplete":
            save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, str(folder / "adapter_model.safetensors"))
    return bad_files


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_bad_eval_argument(argv, fragment, eval_files, capsys, monkeypatch):
    """Through `lowvram-grpo eval ...` (run.main's dispatch). Nothing heavy may start: the model loader is
    replaced by one that fails the test if called."""
    import lowvram_grpo.model.backends as backends

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was refused")

    monkeypatch.setattr(backends, "load_model", must_not_load)
    argv = _fill(argv, eval_files)
    before = _snapshot(eval_files)
    code, stderr = _main(["eval", *argv], capsys)
    _assert_refused(code, stderr, _fill([fragment], eval_files)[0])
    assert _snapshot(eval_files) == before


def test_every_eval_option_has_a_case():
    from lowvram_grpo.evaluate.cli import build_parser

    options = {s for action in build_parser()._actions for s in action.option_strings} - {"-h", "--help"}
    covered = {arg.split("=")[0] for _, argv, _ in EVAL_CASES for arg in argv if arg.startswith("--")}
    assert options - covered == set(), "add a bad-value case to EVAL_CASES"


@pytest.mark.slow
def test_eval_in_a_fresh_process(eval_files):
    """`python -m lowvram_grpo.evaluate` itself: one line, exit 2."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.evaluate", "--adapter",
                           str(eval_files / "adapter-other"),
                           "--preset", "tiny"], cwd=REPO, capture_output=True, text=True, timeout=120)
    _assert_refused(proc.returncode, proc.stderr, "was made for someone/Other-Model-7B")


# ---------------------------------------------------------------- the user's files and folders, before any weights load
FRONT_DOOR_CASES = [
    # a folder the permission bits call writable (root) that no write reaches: /sys is a virtual filesystem
    ("output-dir-not-writable", ["--output-dir", "/sys/kernel/lowvram-never"], "/sys/kernel is not writable"),
    ("model-config-not-json", ["--set", "model.name={tmp}/front-broken-config"], "its config.json is not valid JSON"),
    ("model-config-no-model-type", ["--set", "model.name={tmp}/front-no-model-type"], "names no model_type"),
    ("model-tokenizer-not-json", ["--set", "model.name={tmp}/front-broken-tokenizer"],
     "its tokenizer_config.json is not readable JSON"),
    ("model-folder-without-config", ["--set", "model.name={tmp}"], "is a folder without a config.json"),
]


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in FRONT_DOOR_CASES], ids=[c[0] for c in FRONT_DOOR_CASES])
def test_files_and_folders_refused_before_any_weights_load(argv, fragment, bad_files, capsys, monkeypatch):
    """Each refused in one `error:` line with exit 2 by the pipeline's first step: transformers never loads a model
    (every from_pretrained of a model class is counted), nothing is written."""
    import transformers

    for name in ("front-broken-config", "front-no-model-type", "front-broken-tokenizer"):
        folder = bad_files / name
        if not folder.exists():
            shutil.copytree(bad_files / "tiny-no-weights", folder)
    (bad_files / "front-broken-config" / "config.json").write_text('{"model_type": "llama",')
    (bad_files / "front-no-model-type" / "config.json").write_text('{"hidden_size": 64}')
    (bad_files / "front-broken-tokenizer" / "tokenizer_config.json").write_text("{not json")
    loads = []
    original = transformers.PreTrainedModel.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        loads.append(cls.__name__)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(counted))
    _check_case(["--preset", "tiny", "--max-steps", "1"] + argv, fragment, bad_files, capsys)
    assert loads == [], f"weights were loaded before the refusal: {loads}"
