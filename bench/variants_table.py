"""Issue 33's table: what the reward teaches, and the field's GRPO variants, on the default job, per seed.

    python -m bench.variants_table run --seed 3407 --root runs/variants    # one seed, ~50 min on 2 bf16 cores
    python -m bench.variants_table run --seed 1 --only control             # the default and the control only
    python -m bench.variants_table table                                   # docs/results.md's table, from the JSON

`run` does, for one seed, each step only if its result is not there yet (so a stopped seed goes on):
1. default: the `smollm2_cpu` preset as a new user runs it (priming, then GRPO), seed S, in ROOT/default-S;
2. control: `python -m lowvram_grpo.baseline ROOT/default-S --control random-reward` (the same GRPO, rewards random);
3. gspo / dynamic: GRPO from that run's primed adapter (prime once, train each variant from it) with
   train.importance_sampling_level=sequence, or with train.dynamic_sampling=true judged by correctness (DAPO's
   accuracy filter); `--only dynamic_total` also runs dynamic sampling judged by the weighted total reward.
Every step is a real command (subprocess, the CLI a user types); after each, the seed's numbers are written to
bench/results/variants/seed-S.json (held-out columns, paired changes against the primed adapter and against the
default's after, seconds, steps, rollouts), so `table` needs only the committed JSON, not the run folders.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from bench.harness import accuracy_cell, paired_cell, run_cli, seed_table_parser
from lowvram_grpo.evaluate.evaluation import paired_change
from lowvram_grpo.report.run_dir import RunDir

OUT = Path("bench/results/variants")
PRESET = "smollm2_cpu"
VARIANTS = {  # name: (label, extra --set overrides for a GRPO run from the default's primed adapter)
    "gspo": ("GSPO (importance_sampling_level=sequence)", ["train.importance_sampling_level=sequence"]),
    "dynamic": ("dynamic sampling (DAPO: by correctness)",
                ["train.dynamic_sampling=true", "train.dynamic_sampling_reward=correctness"]),
    # by the weighted total reward (TRL's zero-std test): the preset's graded format rewards leave no group all
    # equal, so it drops nothing here (seed 3407: the default's numbers exactly). Run only when named in --only.
    "dynamic_total": ("dynamic sampling (by the weighted total)", ["train.dynamic_sampling=true"]),
}
ON_REQUEST = ("dynamic_total",)  # VARIANTS that `run` leaves out unless --only names them; `table` shows them where run
KEEP = ("accuracy_strict", "accuracy_strict_ci", "accuracy_lenient", "accuracy_lenient_ci", "format_rate", "n")
KEYS = ("accuracy_strict", "accuracy_lenient")


def _column(numbers: dict) -> dict:
    return {k: numbers[k] for k in KEEP if k in numbers}


def _rollouts(run: Path) -> dict:
    """Completions generated for training, and dynamic sampling's extra ones, from the run's metrics.jsonl."""
    rows = [r for r in RunDir(run, writer=False).read_metrics(required=False) if "step" in r]
    extra = sum(r.get("dynamic_sampling/extra_rollouts") or 0 for r in rows)
    dropped = sum(r.get("dynamic_sampling/zero_signal_groups_dropped") or 0 for r in rows)
    return {"extra_rollouts": extra, "zero_signal_groups_dropped": dropped}


def _entry(label: str, command: str, wall: float, numbers: dict, primed: dict, default_after: dict,
           steps: int, train_seconds: float, rollouts: dict | None = None) -> dict:
    return {"label": label, "command": command, "wall_seconds": wall, "steps": steps, "train_seconds": train_seconds,
            "after": _column(numbers), **(rollouts or {}),
            "vs_primed": {k: paired_change(primed, numbers, k) for k in KEYS},
            "vs_default": {k: paired_change(default_after, numbers, k) for k in KEYS}}


def run_seed(seed: int, root: Path, only: tuple[str, ...] = ()) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"seed-{seed}.json"
    record = json.loads(out.read_text()) if out.is_file() else {"seed": seed, "preset": PRESET, "variants": {}}
    seeded = ["--set", f"train.seed={seed}", "--set", f"lora.random_state={seed}"]
    default = root / f"default-{seed}"

    def save():
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", flush=True)

    if "default" not in record["variants"]:
        argv = ["lowvram_grpo.run", "--preset", PRESET, *seeded, "--output-dir", str(default)]
        if (default / "summary.json").is_file() and RunDir(default, writer=False).complete_summary():
            wall = None  # finished by an earlier `run` whose record was lost: numbers only
        else:
            argv.append("--overwrite")
            wall, _ = run_cli(argv, root / f"default-{seed}.log")
        s = RunDir(default, writer=False).complete_summary()
        record["before"], record["primed"] = _column(s["before"]), _column(s["primed"])
        record["_verdicts"] = {c: {k: s[c].get(k) for k in ("strict_correct", "lenient_correct")}
                               for c in ("primed", "after")}
        record["priming_seconds"] = (s.get("priming") or {}).get("seconds")
        record["variants"]["default"] = _entry("default (the preset)", "python -m " + " ".join(argv), wall,
                                               s["after"], s["primed"], s["after"], s["steps"], s["train_seconds"])
        save()
    primed = {**record["primed"], **record["_verdicts"]["primed"]}
    default_after = {**record["variants"]["default"]["after"], **record["_verdicts"]["after"]}

    if "control" not in record["variants"]:
        argv = ["lowvram_grpo.baseline", str(default), "--control", "random-reward"]
        wall, _ = run_cli(argv, root / f"control-{seed}.log")
        c = json.loads((default / "control_random_reward" / "summary.json").read_text())
        record["variants"]["control"] = _entry("random-reward control", "python -m " + " ".join(argv), wall,
                                               c["control_random_reward"], primed, default_after, c["steps"],
                                               c["train_seconds"])
        save()

    for name, (label, sets) in VARIANTS.items():
        if name in record["variants"] or (only and name not in only) or (not only and name in ON_REQUEST):
            continue
        folder = root / f"{name}-{seed}"
        argv = ["lowvram_grpo.run", "--preset", PRESET, *seeded, "--init-adapter", str(default / "primed_adapter"),
                "--set", "prime.steps=0", *[a for s in sets for a in ("--set", s)], "--output-dir", str(folder),
                "--overwrite"]
        wall, _ = run_cli(argv, root / f"{name}-{seed}.log")
        s = RunDir(folder, writer=False).complete_summary()
        record["variants"][name] = _entry(label, "python -m " + " ".join(argv), wall, s["after"], primed,
                                          default_after, s["steps"], s["train_seconds"], _rollouts(folder))
        save()
    return out


def table(records: list[dict]) -> str:
    lines = ["| seed | variant | after, strict [95 % CI] | vs primed (right/wrong, p) | vs default's after | "
             "format | GRPO s (steps) | extra rollouts |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['seed']} | primed (start of each) | {accuracy_cell(r['primed'], 'accuracy_strict')} | | | "
                     f"{r['primed']['format_rate']:.3f} | | |")
        for name in ("default", "control", *VARIANTS):
            v = r["variants"].get(name)
            if v is None and name in ON_REQUEST:
                continue
            if v is None:
                lines.append(f"| {r['seed']} | {name} | not run | | | | | |")
                continue
            vs_default = "" if name == "default" else paired_cell(v["vs_default"]["accuracy_strict"])
            extra = v.get("extra_rollouts")
            lines.append(f"| {r['seed']} | {v['label']} | {accuracy_cell(v['after'], 'accuracy_strict')} | "
                         f"{paired_cell(v['vs_primed']['accuracy_strict'])} | {vs_default} | "
                         f"{v['after']['format_rate']:.3f} | {v['train_seconds']:.0f} ({v['steps']}) | "
                         f"{'' if extra is None else int(extra)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser, one = seed_table_parser("bench.variants_table", __doc__, OUT, Path("runs/variants"))
    one.add_argument("--only", default="", help=f"comma-separated, among default, control, {', '.join(VARIANTS)}: "
                     "what to run this time (default: all); the default and the control always come first")
    args = parser.parse_args(argv)
    if args.what == "run":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        only = tuple(n for n in args.only.split(",") if n)
        unknown = [n for n in only if n not in ("default", "control", *VARIANTS)]
        if unknown:
            parser.error(
                f"--only: unknown variant {unknown[0]!r}; choose among default, control, {', '.join(VARIANTS)}")
        run_seed(args.seed, args.root, only)
        return 0
    records = [json.loads(p.read_text()) for p in sorted(OUT.glob("seed-*.json"))]
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
