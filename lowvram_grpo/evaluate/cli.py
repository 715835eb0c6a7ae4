"""`lowvram-grpo eval`: score the base model and adapters on held-out questions, with the run's checks.

    lowvram-grpo eval --adapter RUN/adapter                              # the run's own held-out questions
    lowvram-grpo eval --adapter RUN/primed_adapter --adapter RUN/adapter --dataset test.jsonl
    lowvram-grpo eval --model HuggingFaceTB/SmolLM2-135M-Instruct --adapter ~/their_lora --dataset my.jsonl --json
    lowvram-grpo eval --adapter RUN/adapter --without-tools              # a run with tools: also without them
    python -m lowvram_grpo.evaluate ...                                  # the same command

Columns: the base model, then each `--adapter` (ours, or any PEFT adapter of the same base), all on the
same questions under the same protocol (evaluation.py: greedy by default; `--set eval.samples=4` adds
mean@4 and pass@4). Printed: the table with 95% intervals, each adapter's paired change against the base
(and against the adapter before it), questions newly right / newly wrong with McNemar's p; `--json` prints
one JSON object instead, for scripts.

Settings: an adapter inside a run folder (RUN/adapter, RUN/primed_adapter) brings the run's config.yaml
(model, prompts, rewards, completion length, eval settings, held-out split); else `--preset` (default:
the machine's default preset); `--set` overrides either. `--model` names the base model (a hub id, a
local folder or builtin:NAME); every adapter's `base_model_name_or_path` is checked against it before
anything loads. Questions: without `--dataset`, the config's held-out split (a run's own `data.eval_size`
questions); with `--dataset FILE` (any file or hub id the trainer accepts, read by data.load_questions),
every question of it, or the first `--limit N` in the data seed's order (those a run with
`data.eval_dataset=FILE`, `data.eval_size=N` holds out). Bad arguments and bad input are one `error:` line
and exit 2 before the model loads.

Tools: a config with tools (tools.names, an environment) answers multi-turn with them (tool_turns.py).
`--without-tools` measures every column a second time without them ("NAME no-tools": no schemas in the
prompt, one turn), right beside it, with the paired change between the two: what the tools add to that model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from lowvram_grpo.settings.builtin_names import TINY_VERSION
from lowvram_grpo.model.lora_io import check_adapter_dir
from lowvram_grpo.model.smollm2 import CONVERTED_NAME
from lowvram_grpo.core import stops
from lowvram_grpo.core.commands import ArgumentParser, guarded, positive_int
from lowvram_grpo.core.errors import AdapterError, ConfigError
from lowvram_grpo.settings import checks
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.memory_fit import default_preset
from lowvram_grpo.settings.plans import run_plan
from lowvram_grpo.settings.resolve import resolve
from lowvram_grpo.task.data import load_questions, to_prompt_rows

PROG = "lowvram-grpo eval"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Score the base model and adapters on held-out questions: "
                       "accuracy with 95% intervals and paired changes, greedy by default.")
    p.add_argument("--adapter", dest="adapters", action="append", default=[], metavar="[NAME=]PATH",
                   help="a saved LoRA adapter (a run's RUN/adapter, or any PEFT adapter of the base model); repeatable")
    p.add_argument("--dataset", help="questions to score: a .jsonl/.json/.parquet file or hub id the trainer accepts "
                   "(default: the config's held-out split)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="score the first N questions only")
    p.add_argument("--preset", help="settings when no adapter comes from a run folder (default: the machine's "
                   "default preset)")
    p.add_argument("--model", help="the base model (model.name): a hub id, a local folder or builtin:NAME")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set eval.samples=4")
    p.add_argument("--backend", default="auto", choices=["auto", "unsloth", "hf"], help="model backend (default: auto)")
    p.add_argument("--without-tools", action="store_true", help="with a config that has tools: measure each column "
                   "again without them, beside it, with the paired change")
    p.add_argument("--json", action="store_true", help="print one JSON object (columns, protocol, paired changes) "
                   "instead of the table")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


# --------------------------------------------------------------------------- what to score (no heavy imports)

@dataclasses.dataclass
class Column:
    name: str
    adapter: Optional[Path]  # None: the base model


def adapter_columns(specs: list[str]) -> list[Column]:
    """`[NAME=]PATH` -> named columns, each adapter checked complete (AdapterError, exit 2)."""
    parsed = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or "/" in name:
            name, path = "", spec
        path = Path(path).expanduser()
        try:
            check_adapter_dir(path)
        except AdapterError as exc:
            raise AdapterError(f"--adapter {spec}: {exc}", exit_code=2) from None
        parsed.append((name, path.resolve()))
    names = [name or path.name for name, path in parsed]
    columns = []
    for (name, path), short in zip(parsed, names):
        label = name or (short if names.count(short) == 1 else f"{path.parent.name}/{path.name}")
        columns.append(Column(label, path))
    if len({c.name for c in columns} | {"base"}) != len(columns) + 1:
        raise ConfigError(f"two columns have the same name ({', '.join(c.name for c in columns)}): "
                          "name them --adapter NAME=PATH")
    return columns


def run_config_path(columns: list[Column]) -> Optional[Path]:
    """The config.yaml of the run folder an adapter sits in (RUN/adapter, RUN/primed_adapter), if any."""
    for column in columns:
        candidate = column.adapter.parent / "config.yaml"
        if candidate.is_file():
            return candidate
    return None


NO_TOOLS = ["tools.names=[]", "tools.module=null", "environment.module=null", "environment.name=null"]


def build_config(args, columns: list[Column], without_tools: bool = False):
    overrides = list(args.overrides) + (NO_TOOLS if without_tools else [])
    if args.model:
        overrides.append(f"model.name={args.model}")
    if args.limit and not args.dataset:
        overrides.append(f"data.eval_size={args.limit}")
    source = args.preset or run_config_path(columns)
    if source is None:

        source = default_preset()
    return load_config(str(source), overrides)


def _base_key(name: str) -> str:
    """A model name compared across spellings: the last path component, lower case, without the
    quantized-copy suffixes unsloth's hub names add and Meta's 'meta-' prefix."""
    key = str(name).rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-unsloth-bnb-4bit", "-bnb-4bit", "-unsloth"):
        key = key.removesuffix(suffix)
    return key.removeprefix("meta-")


def model_keys(model_name: str) -> set[str]:
    """Every spelling of the base model an adapter may name: for a built-in model its hub name and its
    cache folder (ours record that path), else the name itself."""

    builtin = {"builtin:smollm2": ["HuggingFaceTB/SmolLM2-135M-Instruct", CONVERTED_NAME],
               "builtin:tiny": [f"tiny-llama-{TINY_VERSION}"]}
    return {_base_key(n) for n in [model_name, *builtin.get(model_name, [])]}


def check_bases(columns: list[Column], model_name: str) -> list[str]:
    """Refuse an adapter made for another base model (AdapterError, exit 2, before anything loads);
    returns notes for adapters that do not name their base."""

    keys, notes = model_keys(model_name), []
    for column in columns:
        base = check_adapter_dir(column.adapter).get("base_model_name_or_path")
        if not base:
            notes.append(f"note: {column.adapter} does not name its base model; its shapes are checked when it loads")
        elif _base_key(base) not in keys:
            raise AdapterError(f"adapter {column.adapter} was made for {base}, not for the model here ({model_name}): "
                               f"pass --model {base} (or that model's folder)", exit_code=2)
    return notes


def load_rows(config, dataset: Optional[str], limit: Optional[int]) -> tuple[list[dict], str]:
    """The questions as prompt rows and a description of where they came from, through data.load_questions
    (the trainer's reader and checks)."""

    if dataset is None:
        _, questions = load_questions(config.data)
        where = f"the held-out split of {config.data.dataset or 'the built-in problems'}"
        if config.data.eval_dataset:
            where = f"{config.data.eval_dataset} (data.eval_dataset)"
    else:  # every question of the file, in the data seed's order (eval split first, then the rest)
        whole = dataclasses.replace(config.data, dataset=dataset, eval_dataset=None, eval_size=1, num_train=None)
        train, held_out = load_questions(whole)
        questions = (held_out + train)[:limit] if limit else held_out + train
        where = dataset
    return to_prompt_rows(questions, config.data.system_prompt), where


# --------------------------------------------------------------------------- scoring and output

def comparisons(columns: list[tuple[str, dict]], twins: bool = False) -> list[tuple[str, dict, str, dict]]:
    """Each adapter against the base, and each adapter against the one before it. With `twins` (--without-tools:
    every column followed by itself measured without tools): each column against its twin, and the comparisons
    above within each kind (with tools, without)."""
    if twins:
        return ([(a_name, a, b_name, b) for (a_name, a), (b_name, b) in zip(columns[::2], columns[1::2])]
                + comparisons(columns[::2]) + comparisons(columns[1::2]))
    base_name, base = columns[0]
    pairs = [(base_name, base, name, numbers) for name, numbers in columns[1:]]
    pairs += [(a_name, a, b_name, b) for (a_name, a), (b_name, b) in zip(columns[1:], columns[2:])]
    return pairs


def as_json(config, where: str, named: list[tuple[str, dict]], adapters: list[Optional[Path]],
            twins: bool = False) -> dict:
    # loads transformers
    from lowvram_grpo.evaluate.evaluation import WITH_INTERVAL, paired_change, protocol, protocol_label

    paired = []
    for start_name, start, end_name, end in comparisons(named, twins):
        for key in WITH_INTERVAL:
            got = paired_change(start, end, key)
            if got is not None:
                paired.append({"from": start_name, "to": end_name, "metric": key, "change": end[key] - start[key],
                               "newly_right": got[0], "newly_wrong": got[1], "mcnemar_p": got[2]})
    measured = run_plan(config).eval
    return {"model": config.model.name, "questions": where, "n": named[0][1]["n"],
            "protocol": protocol(measured), "protocol_label": protocol_label(protocol(measured)),
            "columns": [{"name": name, "adapter": str(path) if path else None, **numbers}
                        for (name, numbers), path in zip(named, adapters)],
            "paired": paired}


def score_columns(args) -> int:
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    columns = adapter_columns(args.adapters)
    config = build_config(args, columns)
    for note in check_bases(columns, config.model.name):
        say(note)

    plain = None
    if args.without_tools:
        if not config.uses_tools:
            raise ConfigError("--without-tools: these settings have no tools (tools.names, environment) to measure "
                              "without; give a run's adapter whose config.yaml has them, or drop --without-tools")
        plain = build_config(args, columns, without_tools=True)

    checks.before_load(config)
    resolved = resolve(config, detect(), args.backend)
    rows, where = load_rows(config, args.dataset, args.limit)
    # everything is accepted: load the model
    from lowvram_grpo.model.backends import load_model, prepare_backend

    prepare_backend(resolved.backend)
    handle = load_model(resolved, log=say)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # loads transformers
    from lowvram_grpo.evaluate.evaluation import evaluate, format_columns, protocol, protocol_label

    say(f"{config.model.name} on {len(rows)} questions from {where}; {protocol_label(protocol(resolved.plan.eval))}")
    named = []
    column = None
    try:
        with stops.deferred("after this batch of answers"):  # a signal stops between batches (stops.py)
            for column in [Column("base", None), *columns]:
                say(f"measuring {column.name} ...")
                request = None
                if column.adapter is not None:
                    try:
                        request = handle.load_lora(column.adapter)
                    except AdapterError as exc:
                        raise AdapterError(str(exc), exit_code=2) from None
                numbers, _ = evaluate(handle, rows, resolved.plan.eval, lora_request=request)
                named.append((column.name, numbers))
                if plain is not None:
                    say(f"measuring {column.name} without tools ...")
                    numbers, _ = evaluate(handle, rows, run_plan(plain).eval, lora_request=request)
                    named.append((f"{column.name} no-tools", numbers))
                if request is not None:  # one adapter in memory at a time, however many columns
                    handle.release_lora(request)
    except stops.StopRequested as exc:
        raise stops.StopRequested(exc.signum, f"stopped by {stops.name(exc.signum)} while measuring {column.name}: "
                                              f"eval writes nothing; run it again: {stops.same_command()}") from None
    if args.json:
        adapters = [a for c in [Column("base", None), *columns] for a in [c.adapter] * (2 if plain else 1)]
        print(json.dumps(as_json(config, where, named, adapters, twins=plain is not None), indent=1))
    else:
        print(f"\n{config.model.name}, {len(rows)} questions from {where}")
        print(format_columns(named, comparisons(named, twins=plain is not None)))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return guarded(lambda: score_columns(args), debug=args.debug)
