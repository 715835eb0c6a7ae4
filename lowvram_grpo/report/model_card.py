"""The run folder's model card (`README.md`): what the adapter is, how it was trained and measured, how to load it.

TRL's trainer writes a README.md into the output dir at every checkpoint, naming the base model as
`[None](https://huggingface.co/None)` with `pipeline(model="None")` (a PEFT model handed to the trainer has no
hub id it can read). At the end of a run, `pipeline.GRPORun.finish()` writes this card over it (through
`RunDir.write_model_card`, atomically), from the finished summary.json and config.yaml:

- the real base model (`model.name`; a built-in one says how to get its folder), the preset, the backend;
- the data: the built-in problems or the dataset, the held-out split, the rewards and their weights;
- the held-out numbers before / primed / after with their intervals, and the paired changes as summary.json
  stores them (`paired_changes`, computed once: report.md and the printed table show the same);
- how to load the adapter: PEFT's `PeftModel.from_pretrained`, `lowvram-grpo eval --adapter`, training on
  from it with `--init-adapter`.

A pure function of its inputs (nothing heavy imported): `render(summary, config, run_dir)`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from lowvram_grpo.settings.builtin_names import BUILTIN_DESCRIPTIONS, is_builtin
from lowvram_grpo.report.run_dir import ADAPTER, PRIMED_ADAPTER, RunDir, train_on_command

TAGS = ("lowvram_grpo", "grpo", "lora", "peft", "trl")


def _front_matter(model: str) -> str:
    lines = ["---", "library_name: peft"]
    if model and not is_builtin(model) and not Path(model).is_absolute() and not Path(model).expanduser().exists():
        lines.append(f"base_model: {model}")  # a hub id; a built-in or a local folder is no hub link
    lines += ["tags:"] + [f"- {tag}" for tag in TAGS] + ["---"]
    return "\n".join(lines)


def data_lines(config: dict) -> list[str]:
    """Where the training and held-out questions came from, in the config's words."""
    data = config.get("data") or {}
    dataset = data.get("dataset")
    if dataset:
        train = f"`{dataset}` (data.num_train: {data.get('num_train') or 'all'})"
    else:
        train = (f"the built-in arithmetic word problems (data.num_train: {data.get('num_train') or 2000}, numbers up "
                 f"to data.max_operand = {data.get('max_operand')}, data.seed {data.get('seed')})")
    held_out = (f"{data.get('eval_size')} questions of `{data['eval_dataset']}`" if data.get("eval_dataset")
                else f"{data.get('eval_size')} questions held out of the training data (never trained on)")
    rewards = config.get("rewards") or {}
    names, weights = rewards.get("names") or [], rewards.get("weights")
    weighted = ", ".join(f"{n} x{w:g}" for n, w in zip(names, weights)) if weights else ", ".join(names)
    return [f"- Training questions: {train}.", f"- Held-out questions: {held_out}.",
            f"- Rewards: {weighted or '-'}" + (f" (plus `{rewards['module']}`)" if rewards.get("module") else "") + "."]


def training_lines(summary: dict, config: dict) -> list[str]:
    train, lora, prime = config.get("train") or {}, config.get("lora") or {}, config.get("prime") or {}
    resolved = summary.get("resolved") or {}
    lines = [f"- {summary.get('steps')} GRPO steps (train.num_generations {train.get('num_generations')}, "
             f"learning rate {train.get('learning_rate')}, beta {train.get('beta')}, max_completion_length "
             f"{train.get('max_completion_length')}) in {summary.get('train_seconds')} s on {summary.get('device')} "
             f"({resolved.get('hardware', '?')}, backend {summary.get('backend')}, {resolved.get('dtype', '?')}"
             f"{', 4-bit NF4 base' if resolved.get('load_in_4bit') else ''}); the whole run took "
             f"{summary.get('total_seconds')} s.",
             f"- LoRA r {lora.get('r')}, alpha {lora.get('alpha')}, on {', '.join(lora.get('target_modules') or [])}."]
    if prime.get("steps"):
        lines.append(f"- Primed first: {prime['steps']} supervised steps on worked solutions (`{PRIMED_ADAPTER}/`).")
    if summary.get("init_adapter"):
        lines.append(f"- Started from the adapter in `{summary['init_adapter']}`.")
    return lines


def paired_lines(summary: dict) -> list[str]:
    """The paired changes as summary.json stores them (`paired_changes`)."""
    names = {"primed_to_after": "primed -> after (GRPO's own change)", "before_to_after": "before -> after"}
    lines = []
    for pair, entry in (summary.get("paired_changes") or {}).items():
        for key, change in entry.items():
            p = change["mcnemar_p"]
            lines.append(f"- {key}, {names.get(pair, pair)}: {change['newly_right']} newly right, "
                         f"{change['newly_wrong']} newly wrong of {change['n']} questions "
                         f"(McNemar p {'< 0.001' if p < 0.001 else f'= {p:.3f}'}).")
    return lines


def loading_section(model: str, run_dir: Path, load_in_4bit: bool) -> str:
    adapter = run_dir / ADAPTER
    if is_builtin(model):
        base = (f"from lowvram_grpo.model.builtin_models import resolve_model_path\n\n"
                f"base_path = resolve_model_path({model!r})  # {model} is built locally on first use")
    else:
        base = f"base_path = {model!r}"
    quantized = ("\n# trained on a 4-bit (NF4) base: for the numbers above, load the base the same way, e.g.\n"
                 "# AutoModelForCausalLM.from_pretrained(base_path, quantization_config=BitsAndBytesConfig("
                 "load_in_4bit=True, bnb_4bit_quant_type='nf4'))") if load_in_4bit else ""
    return f"""With PEFT (the adapter folder holds the tokenizer too):

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

{base}
tokenizer = AutoTokenizer.from_pretrained({str(adapter)!r})
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), {str(adapter)!r}){quantized}
```

Prompt it as it was trained: the system prompt of `config.yaml` (`data.system_prompt`), then the question, in
the tokenizer's chat template.

With this tool:

```bash
lowvram-grpo eval --adapter {adapter}        # the held-out numbers again (python -m lowvram_grpo.evaluate ...)
{train_on_command(run_dir)}    # train on from it
```"""


def render(summary: dict, config: dict, run_dir) -> str:
    """The card's markdown for a finished run: `summary` (summary.json), `config` (config.yaml as a mapping)."""
    from lowvram_grpo.report.build import comparison_table  # loads transformers

    run_dir = Path(run_dir)
    model = summary.get("model") or (config.get("model") or {}).get("name") or "?"
    preset = summary.get("preset") or config.get("preset") or "?"
    numbers = comparison_table(summary)
    paired = paired_lines(summary)
    load_in_4bit = bool((summary.get("resolved") or {}).get("load_in_4bit"))
    sections = [
        _front_matter(model),
        f"# LoRA adapter for {model}, trained with GRPO (lowvram_grpo preset `{preset}`)",
        f"A LoRA adapter (`{ADAPTER}/`) of the base model **{model}**, trained with GRPO (TRL's GRPOTrainer, run by "
        f"lowvram_grpo) from the preset `{preset}`. Written at the end of the run from `summary.json` and "
        f"`config.yaml` (in place of the card TRL's trainer writes); `report.md` holds the plots and the "
        f"training-signal warnings.",
        "## Base model\n\n" + f"`{model}`" + (f": {BUILTIN_DESCRIPTIONS.get(model, 'a lowvram_grpo built-in model')} "
                                               "(a built-in name, not a hub id)" if is_builtin(model) else ""),
        "## Data\n\n" + "\n".join(data_lines(config)),
        "## Training\n\n" + "\n".join(training_lines(summary, config)),
        "## Held-out numbers\n\n" + numbers,
        "## Paired changes\n\n" + ("\n".join(paired) if paired else
                                   "None: the columns have no per-question verdicts (evaluation off, or no gold "
                                   "answers)."),
        "## How to load the adapter\n\n" + loading_section(model, run_dir, load_in_4bit),
    ]
    return "\n\n".join(sections) + "\n"


def write_card(run_dir, summary: Optional[dict] = None, config: Optional[dict] = None) -> Path:
    """Write README.md into a finished run's folder (over TRL's), from its files unless given."""
    folder = RunDir(run_dir)
    summary = summary if summary is not None else folder.complete_summary() or {}
    config = config if config is not None else folder.read_config_raw()
    return folder.write_model_card(render(summary, config, folder.path))
