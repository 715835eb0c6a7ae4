"""Command line: `python -m lowvram_grpo.run --preset tiny --max-steps 3 --output-dir runs/tiny`.

Errors a user can cause (unknown preset, bad --set, missing dataset, unwritable output dir, a GPU
preset without a GPU) end as one `error: ...` line on stderr and exit 2; nothing is written.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
from dataclasses import replace
from pathlib import Path

from lowvram_grpo.report.run_dir import RunDir
from lowvram_grpo.core import allocator
from lowvram_grpo.core.allocator import forget_preload
from lowvram_grpo.core.commands import ArgumentParser, guarded, positive_int
from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.run.pipeline import default_output_dir, resume, run
from lowvram_grpo.settings.checks import before_load
from lowvram_grpo.settings.config import list_presets, load_config, read_preset
from lowvram_grpo.settings.hardware import PROFILES, detect, no_gpu_without_torch, planning_hardware
from lowvram_grpo.settings.memory_fit import apply_suggestions, default_preset
from lowvram_grpo.settings.memory_plan import plan, run_plan_text
from lowvram_grpo.settings.resolve import choose_host_allocator, resolve, resolve_again


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m lowvram_grpo.run",
                       description="GRPO + LoRA training on one small GPU, or on a CPU.")
    p.add_argument("--preset", default=None, help="preset name (see --list-presets) or a YAML file; default: "
                   "smollm2_cpu without CUDA, the largest GPU preset that fits the card with one")
    p.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.learning_rate=1e-5")
    p.add_argument("--max-steps", type=positive_int, help="training steps (train.max_steps)")
    p.add_argument("--dataset", help="a .jsonl/.json/.csv/.tsv/.parquet file (columns: data.question_column, "
                   "data.answer_column, or TRL's prompt), a hub id or a dataset folder NAME[@config][:split] "
                   "(data.dataset)")
    p.add_argument("--output-dir", type=Path, help="where the run writes its files (default: outputs/PRESET-TIME); "
                   "a folder that holds a run is refused unless --overwrite")
    p.add_argument("--init-adapter", type=Path, metavar="PATH", help="start from a saved PEFT LoRA adapter (e.g. a "
                   "finished run's OUTPUT/adapter): its r, alpha and target modules are used; priming is skipped "
                   "unless --set prime.steps=N (lora.init_adapter)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --output-dir (its files are deleted "
                   "once the new run's data and model are accepted); never one that is still running")
    p.add_argument("--backend", default="auto", choices=["auto", "unsloth", "hf"], help="model backend (default: auto)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue an interrupted run from its newest checkpoint to its configured end "
                        "(its config.yaml; no --preset/--set/--max-steps/--dataset/--output-dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and the memory plan, and exit without training")
    p.add_argument("--gpu", metavar="PROFILE", help="with --dry-run: resolve the settings and plan memory for a named "
                   "card instead of the one present (t4, v100-16gb, rtx3060-12gb, rtx4060-8gb, rtx3090, rtx4090, l4, "
                   "a10g, a100-40gb, h100-80gb, cpu)")
    p.add_argument("--vram", type=_positive_float, metavar="GB", help="plan GPU memory for a card of this many GiB "
                   "(memory.vram_gb) instead of the one present")
    p.add_argument("--auto-fit", action="store_true", help="when the memory plan does not fit the card, apply the "
                   "settings it suggests (printed)")
    p.add_argument("--export", choices=["merged16", "gguf"], help="after training, also write the model with the "
                   "adapter merged in: merged16 (16-bit safetensors) or gguf (q4_k_m; unsloth backend) into "
                   "OUTPUT/export-KIND")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def describe_presets() -> str:
    lines, names = [], list_presets()
    width = max(len(name) for name in names) + 2
    for name in names:
        raw = read_preset(name)
        lines.append(f"{name:<{width}}{raw.get('description', '')}")
    return "\n".join(lines)


_FIXED_BY_RESUME = {"preset": "--preset", "max_steps": "--max-steps", "dataset": "--dataset",
                    "output_dir": "--output-dir", "overwrite": "--overwrite", "init_adapter": "--init-adapter"}


def resume_run(args, restart: bool = False) -> int:
    """--resume RUN_DIR: the run's own config.yaml (with the --set keys a resume may change), continued in
    RUN_DIR; --export here, or the one the run started with, is written at its end."""

    given = [flag for dest, flag in _FIXED_BY_RESUME.items() if getattr(args, dest, None)]
    if given:
        raise ConfigError(f"--resume continues a run with its own config.yaml and output dir: drop {', '.join(given)}")
    config = RunDir(args.resume).resumable_config(args.overrides)
    if args.dry_run:
        print(config.to_yaml(), end="")
        return 0
    if restart:
        start_on_allocator(config, args.backend)

    resume(args.resume, backend=args.backend, overrides=args.overrides, export=args.export)
    return 0


def auto_fit(config, resolved):
    """--auto-fit: (config, resolved) with the memory plan's suggestions applied and re-resolved, saying which."""
    card = resolved.vram_gib
    if card is None:
        raise ConfigError("--auto-fit needs a card size and no GPU is visible: add --vram GB or --gpu PROFILE")
    p = plan(config, resolved)
    if p.fits:
        print(f"auto-fit: {config.preset} already fits a {card:g} GiB card ({p.total_gb:.1f} GiB planned); "
              f"nothing changed")
        return config, resolved
    if not p.suggestions:
        raise ConfigError(f"--auto-fit: no settings of preset {config.preset} fit a {card:g} GiB card "
                          f"({p.no_fit_reason}); "
                          "pick a smaller model, e.g. --preset qwen1_5b_4bit")
    print(f"auto-fit for a {card:g} GiB card: set {', '.join(map(str, p.suggestions))} "
          f"({p.total_gb:.1f} -> {p.suggested_total_gb:.1f} GiB planned)")
    fitted = apply_suggestions(config, p.suggestions)
    return fitted, resolve_again(fitted, resolved)


# `lowvram-grpo WORD ...`: commands beside training, each a module with its own `main(argv) -> int`.
SUBCOMMANDS = {"doctor": "lowvram_grpo.doctor", "eval": "lowvram_grpo.evaluate.cli"}


def main(argv=None, restart: bool = False) -> int:
    """The CLI's work in this process. `restart`: the process may restart itself on the host allocator the
    run resolves to (only `cli()`, the console entry, says so: a caller's process is never replaced).
    `lowvram-grpo doctor ...` / `lowvram-grpo eval ...` hand the rest of the line to that command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return guarded(lambda: _main(args, restart), debug=args.debug)


def cli() -> int:
    """`lowvram-grpo` and `python -m lowvram_grpo.run`: `main` in a process of its own, which restarts on
    mimalloc once the settings are accepted when the run resolves to it (allocator.py)."""

    forget_preload()  # the restarted process: its children get the user's LD_PRELOAD
    code = main(restart=True)
    # The process exits next: its live objects need no cycle collection at exit (the interpreter's collections over
    # torch's, transformers' and TRL's modules took ~1.4 s of every command's exit). Outputs are closed by now.
    gc.freeze()
    return code


def start_on_allocator(config, backend: str) -> None:
    """Restart this process (same command line) with the host allocator `config` resolves to, when it
    does not run on it yet. Called once the settings are accepted, before anything heavy or written. Where no GPU
    can be visible (hardware.no_gpu_without_torch), the allocator is decided as resolve decides it, without importing
    torch; resolve's own refusals then come from the restarted process, before anything heavy as well."""

    if no_gpu_without_torch():  # decided without importing torch (~2 s), which the restarted process imports anyway
        hardware = replace(PROFILES["cpu"], name="present", mimalloc_library=allocator.mimalloc_library())
        chosen = choose_host_allocator(config.memory.host_allocator, hardware)
    else:
        hardware = detect()
        chosen = resolve(config, hardware, backend).host_allocator
    if chosen == "mimalloc" and allocator.active() != "mimalloc":
        allocator.restart_with(hardware.mimalloc_library, sys.orig_argv)


def _main(args, restart: bool = False) -> int:
    if args.list_presets:
        print(describe_presets())
        return 0
    if args.resume is not None:
        return resume_run(args, restart)
    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.dataset is not None:
        overrides.append(f"data.dataset={args.dataset}")
    if args.vram is not None:
        overrides.append(f"memory.vram_gb={args.vram}")
    if args.init_adapter is not None:
        overrides.append(f"lora.init_adapter={args.init_adapter}")
    config = load_config(args.preset or default_preset(), overrides)
    if args.gpu is not None and not args.dry_run:
        raise ConfigError(f"--gpu {args.gpu} plans for a card you name: add --dry-run (training uses the card present)")
    if restart and not args.dry_run:
        before_load(config)  # settings that cannot work are refused here, not after a restart
        start_on_allocator(config, args.backend)
    if args.dry_run or args.auto_fit:
        before_load(config)
        resolved = resolve(config, planning_hardware(config, args.gpu), args.backend)
        if args.auto_fit:
            config, resolved = auto_fit(config, resolved)
        if args.dry_run:
            print(run_plan_text(config, resolved), end="")  # what the run writes to its plan.txt
            return 0

    run(config, args.output_dir or default_output_dir(config.preset), backend=args.backend, export=args.export,
        existing="overwrite" if args.overwrite else "refuse")
    return 0
