"""The default job's settings, chosen on the validation questions only, then its three seeds (issue 53).

    python -m bench.default_job_search search [--variants a,b] [--seeds 3407] [--validation-size 128]
    python -m bench.default_job_search seeds --variant NAME [--seeds 1,2,3407]
    python -m bench.default_job_search record --variant NAME --seed S --run DIR --wall-seconds W --command CMD
    python -m bench.default_job_search table

`search`: each variant (VARIANTS: --set overrides of the smollm2_cpu preset: GRPO steps, prompts a step, learning
rate; priming is the preset's in every variant, so the primed adapter is the same within a seed) runs the whole job
(`python -m lowvram_grpo.run`) with the held-out curve measured once, at its last step, on `--validation-size`
validation questions (eval.every_steps = train.max_steps; validation.py: training questions taken out of training,
never the held-out ones). The record keeps the validation numbers and the time, and nothing of the held-out
questions (summary.json's before / primed / after columns are not read), so the choice cannot be made on them. Pick
the variant with the best validation strict accuracy whose whole run stays within the time budget.

`seeds`: the chosen variant, as the default job would run it, on each seed (train.seed): the held-out primed -> after
strict accuracy, GRPO's own paired change (newly right / newly wrong, McNemar p), and the time, from summary.json
(bench.seeds_table's reading). Issue 53 asks p < 0.01 on seeds 1, 2 and 3407, each whole job within 15 minutes.

Timed figures: run alone (`flock /tmp/lowvram-cpu.lock python -m bench.default_job_search ...`), on the machine the
docs name. Records go to bench/results/default_job/ (one JSON a run, plus what `table` prints).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

from bench.harness import machine, run_cli
from lowvram_grpo.report.learning_signals import SAMPLER_GAP_KEY, SAMPLER_GAP_MAX_KEY

IS_RATIO_KEY = "sampling/importance_sampling_ratio/mean"  # TRL 1.15's name

ROOT = Path("runs/default_job")
OUT = Path("bench/results/default_job")

# name -> --set overrides on top of the smollm2_cpu preset (its priming, rewards and lengths stay)
VARIANTS: dict[str, list[str]] = {
    "preset": [],
    "lr2e-4": ["train.learning_rate=2e-4"],
    "steps72": ["train.max_steps=72"],
    "steps96": ["train.max_steps=96"],
    "three_prompts": ["train.per_device_train_batch_size=24"],
    "steps72_lr2e-4": ["train.max_steps=72", "train.learning_rate=2e-4"],
    "steps96_three_prompts": ["train.max_steps=96", "train.per_device_train_batch_size=24"],
    "steps72_eval256": ["train.max_steps=72", "data.eval_size=256"],  # held-out size: the paired test's n
                                                                      # (not searched on)
    "int8": ["decode.weights=int8"],  # issue 51: rollouts from the int8 base + unmerged adapter,
                                      # against "preset" (bf16)
    "unmerged": ["decode.merge_lora=false"],  # issue 51: the fused layers on the bf16 base in place, adapter unmerged
}


def _steps(overrides: list[str]) -> int:
    from lowvram_grpo.settings.config import load_config

    return load_config("smollm2_cpu", overrides).train.max_steps


def search_one(variant: str, seed: int, validation_size: int) -> dict:
    overrides = [*VARIANTS[variant], f"train.seed={seed}"]
    steps = _steps(overrides)
    run = ROOT / "search" / f"{variant}-seed{seed}"
    sets = [*overrides, f"eval.every_steps={steps}", f"eval.validation_size={validation_size}"]
    argv = ["lowvram_grpo.run", "--preset", "smollm2_cpu", "--output-dir", str(run), "--overwrite",
            *[part for s in sets for part in ("--set", s)]]
    run.parent.mkdir(parents=True, exist_ok=True)
    wall, _ = run_cli(argv, run.parent / f"{run.name}.log")
    from lowvram_grpo.report.run_dir import RunDir

    folder = RunDir(run, writer=False)
    rows = folder.read_metrics()
    last = [r for r in rows if "validation/accuracy_strict" in r][-1]
    summary = folder.complete_summary() or {}
    return {"what": "search", "variant": variant, "overrides": VARIANTS[variant], "seed": seed, "steps": steps,
            "validation": {k.removeprefix("validation/"): v for k, v in last.items() if k.startswith("validation/")},
            "wall_seconds": wall, "run_total_seconds": summary.get("total_seconds"),
            "grpo_train_seconds": summary.get("train_seconds"), "command": "python -m " + " ".join(argv),
            "machine": machine()}


def seeds_one(variant: str, seed: int) -> dict:
    run = ROOT / "seeds" / f"{variant}-seed{seed}"
    sets = [*VARIANTS[variant], f"train.seed={seed}"]
    argv = ["lowvram_grpo.run", "--preset", "smollm2_cpu", "--output-dir", str(run), "--overwrite",
            *[part for s in sets for part in ("--set", s)]]
    run.parent.mkdir(parents=True, exist_ok=True)
    wall, _ = run_cli(argv, run.parent / f"{run.name}.log")
    record = seeds_record(variant, seed, run, wall, "python -m " + " ".join(argv))
    # the largest child's peak RSS (the run: this bench process waits for nothing else); one seed a bench process
    # makes it that run's own
    record["peak_rss_gib_largest_child"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 3)
    return record


def sampler_gap(run: Path) -> "dict | None":
    """The sampler/trainer gap over a run's GRPO steps (TRL's sampling/* metrics in metrics.jsonl, present where the
    importance-sampling correction ran): the mean of each step's mean |trainer - sampler| log-prob a token, the
    largest step max, and the mean of the steps' mean importance ratio; None without them."""
    path = Path(run) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = [r for r in rows if r.get(SAMPLER_GAP_KEY) is not None]
    if not rows:
        return None
    return {"steps": len(rows), "mean_abs_logp_difference": round(sum(r[SAMPLER_GAP_KEY] for r in rows) / len(rows), 4),
            "max_abs_logp_difference": round(max(r[SAMPLER_GAP_MAX_KEY] for r in rows), 3),
            "mean_is_ratio": round(sum(r.get(IS_RATIO_KEY, 1.0) for r in rows) / len(rows), 4)}


def seeds_record(variant: str, seed: int, run: Path, wall: float, command: str) -> dict:
    """The `seeds` record of a finished run folder: held-out strict accuracy per column, GRPO's own paired change
    (primed -> after), the times, the best adapter."""
    from bench.seeds_table import row_of
    from lowvram_grpo.evaluate.evaluation import paired_change

    row = row_of(run)  # one error line and exit 2 where `run` holds no finished run (no config.yaml, no summary)
    if row["seed"] != seed:
        print(f"error: {run} ran train.seed={row['seed']}, not {seed}: name the seed its config.yaml has",
              file=sys.stderr)
        raise SystemExit(2)
    summary = row["summary"]
    right, wrong, p = paired_change(summary["primed"], summary["after"], "accuracy_strict")
    return {"what": "seeds", "variant": variant, "overrides": VARIANTS[variant], "seed": seed, "wall_seconds": wall,
            "run_total_seconds": summary["total_seconds"], "grpo_train_seconds": summary["train_seconds"],
            "steps": summary["steps"], "n": summary["after"]["n"],
            **{c: summary[c]["accuracy_strict"] for c in ("before", "primed", "after")},
            "paired_grpo": {"right": right, "wrong": wrong, "p": p}, "best_adapter": summary.get("best_adapter"),
            "sampler_gap": sampler_gap(run), "command": command, "machine": machine()}


def table() -> str:
    records = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    lines = ["| variant | seed | GRPO steps | validation strict (n) | whole run s |", "|---|---|---|---|---|"]
    for r in (r for r in records if r["what"] == "search"):
        v = r["validation"]
        lines.append(f"| {r['variant']} | {r['seed']} | {r['steps']} | {v['accuracy_strict']:.3f} ({v['n']}) | "
                     f"{r['run_total_seconds']} |")
    lines += ["", "| variant | seed | primed -> after strict (n) | GRPO newly right / wrong, McNemar p | whole run s |",
              "|---|---|---|---|---|"]
    for r in (r for r in records if r["what"] == "seeds"):
        g = r["paired_grpo"]
        lines.append(f"| {r['variant']} | {r['seed']} | {r['primed']:.3f} -> {r['after']:.3f} ({r['n']}) | "
                     f"+{g['right']} / -{g['wrong']}, p {g['p']:.4f} | {r['run_total_seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.default_job_search", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    search = sub.add_parser("search", help="each variant on the validation questions")
    search.add_argument("--variants", default=",".join(VARIANTS))
    search.add_argument("--seeds", default="3407")
    search.add_argument("--validation-size", type=int, default=128)
    seeds = sub.add_parser("seeds", help="the chosen variant on the held-out questions, per seed")
    seeds.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    seeds.add_argument("--seeds", default="1,2,3407")
    made = sub.add_parser("record", help="the seeds record of a run made otherwise (the README's first command)")
    made.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    made.add_argument("--seed", type=int, required=True)
    made.add_argument("--run", type=Path, required=True, help="the finished run folder")
    made.add_argument("--wall-seconds", type=float, required=True, help="the command's wall time, as timed")
    made.add_argument("--command", required=True, help="the command that made the run, as typed")
    sub.add_parser("table", help=f"the tables from {OUT}/*.json")
    args = parser.parse_args(argv)
    if args.what == "table":
        print(table())
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    if args.what == "record":
        record = seeds_record(args.variant, args.seed, args.run, args.wall_seconds, args.command)
        (OUT / f"seeds-{args.variant}-seed{args.seed}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(table())
        return 0
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.what == "search":
            for variant in args.variants.split(","):
                if variant not in VARIANTS:
                    print(f"error: no variant {variant!r}; the variants: {', '.join(VARIANTS)}", file=sys.stderr)
                    return 2
                record = search_one(variant, seed, args.validation_size)
                (OUT / f"search-{variant}-seed{seed}.json").write_text(json.dumps(record, indent=1) + "\n")
        else:
            record = seeds_one(args.variant, seed)
            (OUT / f"seeds-{args.variant}-seed{seed}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
