"""Settings that pass each section's own checks but cannot work together, refused before anything heavy.

config.py checks each value alone (a learning rate > 0, a finite number, ...). Here the settings are
checked against each other and against the model's shape, so a run that would fail an hour in, or run
in a way nobody meant, ends at the start with one `error:` line (ConfigError, exit 2) naming the setting
and a value that works:

- lengths: prompt + completion must fit `model.max_seq_length`, and that must fit the model's context;
- LoRA: every `lora.target_modules` name must be a linear layer the model has, and `lora.r` must not
  exceed the smaller side of any layer it adapts (a rank above that adds parameters, never capacity);
- data: `data.num_train` larger than the data can supply (after the held-out split) is a warning;
- tools: every `tools.names` entry a checked function with a JSON schema, the environment a class that builds,
  with reset and documented tool methods (before the model loads), and a chat template that renders and parses
  tool calls (after).

`before_load(config)` uses what is known without loading: the shape table or a local checkpoint's
config.json, as the run's plan derived them once (plans.ModelPlan.facts: model_shapes.model_facts), and the module
names of the Llama/Qwen/Mistral family. `after_load`
checks the loaded model itself (any architecture), before get_peft_model and before anything is written.
`surprises(config, n_train)` returns the warnings for legal settings a user probably did not mean.
Pure Python; imports nothing heavy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lowvram_grpo.settings.builtin_names import builtin_folder, is_builtin
from lowvram_grpo.settings.adapter_files import adapter_settings, options_beyond_merge
from lowvram_grpo.core.errors import ConfigError, PlanError
from lowvram_grpo.settings.plans import RunPlan, run_plan
from lowvram_grpo.settings.model_shapes import (
    HUB_ID,
    STANDARD_MODULE_FAMILIES,
    ModelFacts,
    cached_config_path,
    hub_offline,
    local_model_config,
)
from lowvram_grpo.task import tools
from lowvram_grpo.task.user_code import of

# The decoder-layer linear modules of Llama-style architectures (Llama, Qwen2, Mistral, SmolLM2) by name.
LLAMA_STYLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
EVAL_TO_TRAIN_WARNING = 5  # warn when evaluation generates this many times the completions training does


def _context_length(facts: ModelFacts) -> Optional[int]:
    """The model's own context (max_position_embeddings) where it is known without loading: a local
    checkpoint's config.json, or the shape (the table for the built-ins and known hub models), from the model's
    facts (derived once for the run)."""
    if facts.local_error:
        return None
    if facts.local:
        return facts.local_context
    return facts.shape.context if facts.shape is not None else None


def _architecture(facts: ModelFacts) -> Optional[str]:
    """'llama' when the model is known to have Llama-style module names without loading it, else None."""
    if facts.local_error:
        return None
    if facts.local:
        return "llama" if any(a in LLAMA_STYLE for a in facts.local_architectures) else None
    return "llama" if facts.shape is not None and facts.shape.family in STANDARD_MODULE_FAMILIES else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_folder(name: str) -> None:
    """A local model folder (model.name a path) is read before anything loads: its config.json must be a JSON
    object naming a model_type, and a tokenizer file must be there, each JSON one readable. One line each; a hub id
    or a built-in name is left to the loader."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return
    try:
        raw = local_model_config(name)
    except PlanError as exc:
        raise ConfigError(f"model.name {name}: its config.json is not valid JSON "
                          f"({str(exc).split('config.json: ', 1)[-1]}): "
                          "restore it from the checkpoint's source, or set model.name to another folder") from None
    if raw is None:
        raise ConfigError(f"model.name {name} is a folder without a config.json: "
                          "give a checkpoint folder (config.json, "
                          "weights, tokenizer), a hub id, or builtin:tiny")
    if not isinstance(raw, dict) or not (raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")):
        raise ConfigError(f"model.name {name}: its config.json names no model_type: give a transformers checkpoint "
                          "folder, or restore its config.json")
    present = [file for file in TOKENIZER_FILES if (folder / file).is_file()]
    if not present:
        raise ConfigError(f"model.name {name} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the tokenizer "
                          "beside the weights (tokenizer.save_pretrained)")
    for file in present:
        if file.endswith(".json"):
            try:
                json.loads((folder / file).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model.name {name}: its {file} is not readable JSON ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:120]}): "
                                  "restore it from the checkpoint's source") from None


def check_offline_model(name: str) -> None:
    """A hub id whose config.json is not in the local hub cache while HF_HUB_OFFLINE is set cannot load: a run
    refuses it before anything loads, naming the file (model_shapes.cached_config_path); a dry-run plans from the
    fallback table instead."""

    if Path(name).expanduser().exists() or not HUB_ID.match(name) or not hub_offline():
        return
    if cached_config_path(name) is None:
        from huggingface_hub import constants

        raise ConfigError(f"model.name {name}: its config.json is not in the local hub cache "
                          f"({constants.HF_HUB_CACHE}) "
                          "and HF_HUB_OFFLINE is set: download it once online (hf download "
                          f"{name}), or set model.name to a local checkpoint folder")


def check_lengths(config, context: Optional[int]) -> None:
    """The rollout's tokens fit model.max_seq_length, which fits the model's context (None: not known yet)."""
    _check_lengths(_model_values(config), context)


def _model_values(config):
    """The values check_lengths and check_lora read, from the config (before the plan exists) or a ModelPlan."""
    return _ModelValues(config.model.name, config.model.max_seq_length, config.train.max_prompt_length,
                        config.train.max_completion_length, config.train.rollout_tokens,
                        tuple(config.lora.target_modules), config.lora.r)


@dataclass(frozen=True)
class _ModelValues:
    name: str
    max_seq_length: int
    max_prompt_length: int
    max_completion_length: int
    rollout_tokens: int
    lora_target_modules: tuple
    lora_r: int


def _check_lengths(m, context: Optional[int]) -> None:
    """`m`: a plans.ModelPlan (or _ModelValues): its lengths against model.max_seq_length and the model's context."""
    need = m.rollout_tokens
    if need > m.max_seq_length:
        raise ConfigError(
            f"train.max_prompt_length ({m.max_prompt_length}) + "
            f"train.max_completion_length ({m.max_completion_length}) "
            f"= {need} tokens do not fit model.max_seq_length ({m.max_seq_length}): set model.max_seq_length={need} "
            f"or lower train.max_completion_length to {max(m.max_seq_length - m.max_prompt_length, 1)}")
    if context is not None and m.max_seq_length > context:
        raise ConfigError(f"model.max_seq_length={m.max_seq_length} is longer than {m.name}'s context of {context} "
                          f"tokens: set model.max_seq_length to at most {context}")


def check_lora(config, layers: dict[str, tuple[int, int]]) -> None:
    """`layers`: linear layer name -> (in, out) features, one decoder layer's (names as PEFT matches them)."""
    _check_lora(_model_values(config), layers)


def _check_lora(m, layers: dict[str, tuple[int, int]]) -> None:
    """`m`: a plans.ModelPlan (or _ModelValues): lora.target_modules and lora.r against the model's layers."""
    missing = [name for name in m.lora_target_modules if name not in layers and name != "lm_head"]
    if missing:
        raise ConfigError(f"lora.target_modules: {m.name} has no {', '.join(repr(x) for x in missing)}; "
                          f"its linear layers are {', '.join(sorted(layers))}")
    targeted = {name: layers[name] for name in m.lora_target_modules if name in layers}
    smallest_name, (a, b) = min(targeted.items(), key=lambda kv: min(kv[1]))
    if m.lora_r > min(a, b):
        raise ConfigError(f"lora.r={m.lora_r} exceeds the smaller side of {smallest_name} ({a} x {b}), the narrowest "
                          f"layer it adapts: a rank above {min(a, b)} adds parameters but no capacity; set "
                          f"lora.r={min(a, b)} or lower")


_COPY_SUFFIXES = ("-unsloth-bnb-4bit", "-bnb-4bit", "-unsloth")  # unsloth's re-uploads of the same weights


def _base_identities(name: str) -> set[str]:
    """What names one base model: a local folder's resolved path and its name, a built-in's folder, a hub id's
    repository name; lower-case, without 'meta-' and unsloth's copy suffixes ('Meta-Llama-3.1-8B-Instruct' and
    'unsloth/llama-3.1-8b-instruct-bnb-4bit' are one model)."""

    ids = set()
    path = Path(builtin_folder(name) or name if is_builtin(name) else name).expanduser()
    if path.is_dir():
        ids.add(str(path.resolve()))
    short = str(path).rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for suffix in _COPY_SUFFIXES:
        short = short.removesuffix(suffix)
    return ids | {short}


def check_init_adapter(config) -> None:
    """lora.init_adapter trained on another base model than model.name is refused before anything loads."""
    if not config.lora.init_adapter:
        return

    recorded = adapter_settings(config.lora.init_adapter)["base_model"]
    if recorded and not _base_identities(recorded) & _base_identities(config.model.name):
        raise ConfigError(f"lora.init_adapter {config.lora.init_adapter} was trained on {recorded}, not on "
                          f"model.name {config.model.name}: set model.name to its base model, or give an adapter "
                          f"trained on {config.model.name}")
    check_init_adapter_merge(config)


def check_init_adapter_merge(config) -> None:
    """An adapter_config.json option our decode loop cannot merge by PEFT's arithmetic (decoding.MERGE_OPTIONS:
    plain LoRA, rslora, alpha), with decode.merge_lora or decode.fused asked for explicitly (or decode.weights=int8,
    which adds the adapter to the int8 base by the same plain-LoRA arithmetic), is refused before
    anything loads; with `auto` the run samples from the unmerged adapter (decoding.install says so)."""


    asked = [f"decode.{key}=true" for key in ("merge_lora", "fused") if getattr(config.decode, key) == "true"]
    asked += ["decode.weights=int8"] if config.decode.weights == "int8" else []  # plain LoRA's arithmetic, unmerged
    if not asked:
        return
    raw = json.loads((Path(config.lora.init_adapter) / "adapter_config.json").read_text(encoding="utf-8"))
    beyond = options_beyond_merge(raw)
    if beyond:
        resets = ["decode.merge_lora=auto", "decode.fused=auto"] + (
            ["decode.weights=auto"] if config.decode.weights == "int8" else [])
        raise ConfigError(f"lora.init_adapter {config.lora.init_adapter} sets {', '.join(beyond)} in its "
                          f"adapter_config.json, which {' and '.join(asked)} cannot merge (merged here: plain LoRA, "
                          f"rslora, alpha): set {', '.join(resets[:-1])} and {resets[-1]} to sample from the "
                          "unmerged adapter")


def check_reward_names(config, plan: Optional[RunPlan] = None) -> None:
    """Every name in rewards.names is a built-in reward, a function of the rewards.module file, or a reward
    model; importing that file is where the user's code first runs (never when a config is built)."""

    of(plan if plan is not None else run_plan(config))  # looked up once for the run (user_code.load):
                                                        # an unknown name or a broken file is one line
    by = config.train.dynamic_sampling_reward
    if by is not None and by not in config.rewards.names:
        raise ConfigError(f"train.dynamic_sampling_reward must be one of the run's rewards.names "
                          f"({', '.join(config.rewards.names)}) or null; got {by!r}")
    if by is not None and not config.train.dynamic_sampling:
        raise ConfigError(f"train.dynamic_sampling_reward={by} does nothing without dynamic sampling: add --set "
                          "train.dynamic_sampling=true, or leave train.dynamic_sampling_reward null")


def check_tools(config, plan: Optional[RunPlan] = None) -> None:
    """tools.names and the environment against what TRL will be handed (tools.py: the files import, each name is a
    function of it or a built-in tool, the environment a class with reset and documented, type-hinted public
    methods, no two tools under one name), then each tool's JSON schema as transformers builds it for the chat
    template (`get_json_schema`: a Google-style docstring whose Args: section describes every parameter, types it
    can express), and the environment built once as TRL builds it; every error one line. Imports the user's files
    and builds the environment (user code runs)."""

    if not config.uses_tools:
        return  # tools.max_tokens_per_turn then caps nothing: a tools preset run with tools.names=[] keeps it
    cap, budget = config.tools.max_tokens_per_turn, config.train.max_completion_length
    if cap is not None and cap > budget:
        raise ConfigError(f"tools.max_tokens_per_turn={cap} is above train.max_completion_length={budget}, which "
                          f"caps the whole trajectory: set it at most {budget}, or null for {budget}")
    from transformers.utils.chat_template_utils import get_json_schema


    user = of(plan if plan is not None else run_plan(config))  # the run's tools and environment,
                                                               # looked up once (user_code.load)
    named = list(zip(config.tools.names, user.tool_functions()))
    cls = user.environment
    if cls is not None:
        probe = user.build_environment(user.bounded_environment())
        for name, _ in tools.environment_methods(type(probe)):
            clash = next((n for n, fn in named if fn.__name__ == name), None)
            if clash is not None:
                raise ConfigError(f"environment {cls.__name__!r} has a method {name!r}, and tools.names has {clash!r} "
                                  "under the same name: the model calls a tool by its name: rename one")
            named.append((f"{cls.__name__}.{name}", getattr(probe, name)))
    for name, fn in named:
        try:
            get_json_schema(fn)  # what TRL is handed: the same schema
        except Exception as exc:  # DocstringParsingException, TypeHintParsingException, a bad (choices: ...) list
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"tool {name!r} cannot be shown to the model as a JSON schema (transformers' "
                              f"get_json_schema: {message}): give it a docstring with an Args: section describing "
                              "each parameter, and type hints of str, int, float, bool, list or dict") from None


def check_chat_template(plan, tokenizer, chat_prompts: bool) -> None:
    """Before the weights load (with the tokenizer alone), when the prompts are chat messages (`chat_prompts`): the
    tokenizer must have a chat template (a base model's often has none: transformers would fail at the first
    rollout), and every `data.chat_template_kwargs` key must be a variable that template reads (a misspelt
    `enable_thinking` would otherwise change nothing, silently)."""
    if not chat_prompts:
        return
    name = plan.model.name
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(f"{name}'s tokenizer has no chat template and the prompts are chat messages: use the model's "
                          "instruct (chat) version, whose tokenizer has one, or give text prompts (a 'prompt' column "
                          "of plain text in data.dataset)")
    sources = " ".join(template.values()) if isinstance(template, dict) else str(template)
    unread = [key for key in plan.prompts.template_kwargs if key not in sources]
    if unread:
        raise ConfigError(f"data.chat_template_kwargs {', '.join(unread)}: {name}'s chat template never reads "
                          f"{'it' if len(unread) == 1 else 'them'}; drop {'it' if len(unread) == 1 else 'them'} "
                          "(or check the spelling against the template)")


def check_tool_template(plan, tokenizer) -> None:
    """Right after the model loads, before anything is written: its chat template must render a tool-calling
    conversation (TRL's supports_tool_calling), TRL must be able to parse its tool calls (a response template
    on the tokenizer, or one TRL knows for the template), and the template must keep earlier turns' tokens when
    turns follow (or TRL must have a training version of it)."""

    if not plan.tools.used:
        return
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    name = plan.model.name
    if not supports_tool_calling(tokenizer):
        raise ConfigError(f"{name}'s chat template cannot render tool calls (TRL needs user -> assistant with "
                          "tool_calls -> tool): choose a model whose template renders tools (builtin:tiny, "
                          "builtin:smollm2, Qwen2.5/Qwen3, Llama 3.1), or drop tools.names")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)  # what TRL does itself for the templates it knows
        except ValueError:
            raise ConfigError(f"TRL cannot parse {name}'s tool calls: its tokenizer has no response_template and TRL "
                              "knows none for its chat template; set one on the model's tokenizer (transformers' "
                              "response parsing), or drop tools.names") from None
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise ConfigError(f"{name}'s chat template renders earlier turns differently once a tool result follows, "
                              "and TRL has no training version of it: "
                              "multi-turn tool calling cannot train on it") from None


def before_load(config, plan: Optional[RunPlan] = None) -> None:
    """What can be refused before the model loads (ConfigError). `plan`: the run's plan (plans.run_plan(config)),
    built once by the caller that also resolves the run; built here when none is given (the doctor, --dry-run)."""
    check_model_folder(config.model.name)  # the user's files first: one line each, before anything heavy
    plan = plan if plan is not None else run_plan(config)
    check_reward_names(config, plan)
    check_tools(config, plan)
    check_init_adapter(config)
    facts = plan.model.facts  # the model's shape, derived once for the run
    check_lengths(config, _context_length(facts))
    if _architecture(facts) == "llama":
        check_lora(config, facts.require_shape().linear_dims())


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """(in, out) features of the model's linear layers by their last name (what PEFT's target_modules match);
    bitsandbytes' Linear4bit is an nn.Linear; GPT-2 style Conv1D keeps its weight as [in, out]."""
    import torch

    layers: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            layers.setdefault(short, (module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":
            layers.setdefault(short, tuple(module.weight.shape))
    return layers


def after_load(plan: RunPlan, model) -> None:
    """What needs the loaded model (any architecture): its context length and its layers, against the run's plan."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    _check_lengths(plan.model, context)
    _check_lora(plan.model, linear_layers(model))


def surprises(config, n_train_available: Optional[int] = None) -> list[str]:
    """Legal settings that are probably not what was meant, one warning line each."""
    out = []
    evals = 0
    if config.eval.enabled:
        evals = config.data.eval_size * (3 if config.prime.steps > 0 else 2) * (1 + config.eval.samples)
    trained = config.train.max_steps * config.train.batch_size \
        * config.train.gradient_accumulation_steps
    if evals > EVAL_TO_TRAIN_WARNING * trained:
        extra = f" x (1 + eval.samples={config.eval.samples})" if config.eval.samples else ""
        out.append(f"warning: evaluation samples {evals} completions "
                   f"(data.eval_size={config.data.eval_size} per measurement{extra}), "
                   f"{evals / trained:.0f}x the {trained} that training samples: lower data.eval_size or train longer")
    if n_train_available is not None and config.data.num_train and config.data.num_train > n_train_available:
        out.append(f"warning: data.num_train={config.data.num_train} "
                   f"but the data has {n_train_available} training rows "
                   f"after the held-out split: training on {n_train_available}")
    return out
