"""The default job's table for docs/results.md, from finished run folders (and their prime-only baselines).

    python -m bench.seeds_table runs/seed-3407 runs/seed-1 runs/seed-2 [--out bench/results/seeds.json]

Each RUN_DIR is a finished `python -m lowvram_grpo.run --output-dir RUN_DIR ...`; when
`RUN_DIR/prime_only/summary.json` exists (`python -m lowvram_grpo.baseline RUN_DIR`), its column is added.
Reads through `RunDir` (the one reader of run folders); prints markdown and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lowvram_grpo.evaluate.evaluation import paired_change
from lowvram_grpo.report.run_dir import RunDir

KEYS = ("accuracy_strict", "accuracy_lenient")


def _acc(col: dict, key: str) -> str:
    lo, hi = col[f"{key}_ci"]
    return f"{col[key]:.3f} [{lo:.2f}, {hi:.2f}]"


def _paired(start: dict, end: dict, key: str) -> str:
    got = paired_change(start, end, key)
    if got is None:
        return "-"
    p = got[2]
    return f"+{got[0]}/-{got[1]} (p {'< 0.001' if p < 0.001 else f'{p:.3f}'})"


def row_of(run: Path) -> dict:
    summary = RunDir(run, writer=False).complete_summary()
    if summary is None:
        print(f"error: {run} has no finished run (summary.json with status complete): give the --output-dir "
              f"of a finished `python -m lowvram_grpo.run`", file=sys.stderr)
        raise SystemExit(2)
    config = RunDir(run, writer=False).read_config()
    baseline = RunDir(run / "prime_only", writer=False).read_summary()  # None when the baseline was not run
    return {"run": str(run), "seed": config.train.seed, "summary": summary, "baseline": baseline}


def markdown(rows: list[dict]) -> str:
    lines = ["| seed | | before | primed | after GRPO | GRPO's own change, paired (newly right/wrong, McNemar p) "
             "| prime-only, same time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, b = r["summary"], r["baseline"]
        for key, label in (("accuracy_strict", "strict"), ("accuracy_lenient", "lenient")):
            base = f"{_acc(b['prime_only'], key)} ({b['priming']['steps']} steps)" if b else "not run"
            lines.append(f"| {r['seed']} | {label} | {_acc(s['before'], key)} | {_acc(s['primed'], key)} | "
                         f"**{_acc(s['after'], key)}** | {s['after'][key] - s['primed'][key]:+.3f}, "
                         f"{_paired(s['primed'], s['after'], key)} | {base} |")
        lines.append(f"| {r['seed']} | format | {s['before']['format_rate']:.3f} | {s['primed']['format_rate']:.3f} | "
                     f"{s['after']['format_rate']:.3f} | | {b['prime_only']['format_rate']:.3f} |" if b else
                     f"| {r['seed']} | format | {s['before']['format_rate']:.3f} | {s['primed']['format_rate']:.3f} | "
                     f"{s['after']['format_rate']:.3f} | | |")
    lines.append("")
    lines.append("| seed | priming s | GRPO s (steps) | s/step | whole run s | held-out n |")
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"]
        priming = s.get("priming") or {}
        lines.append(f"| {r['seed']} | {priming.get('seconds', 0)} | {s['train_seconds']} ({s['steps']}) | "
                     f"{s['train_seconds'] / max(s['steps'], 1):.2f} | {s['total_seconds']} | {s['after']['n']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.seeds_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench/results/seeds.json"))
    args = parser.parse_args(argv)
    rows = [row_of(run) for run in args.runs]
    text = markdown(rows)
    print(text)
    keep = ("accuracy_strict", "accuracy_strict_ci", "accuracy_lenient", "accuracy_lenient_ci", "format_rate",
            "reward_mean", "mean_completion_tokens", "n")
    out = [{"run": r["run"], "seed": r["seed"], "train_seconds": r["summary"]["train_seconds"],
            "total_seconds": r["summary"]["total_seconds"], "steps": r["summary"]["steps"],
            **{c: {k: r["summary"][c][k] for k in keep} for c in ("before", "primed", "after")},
            **{f"paired_{k}": paired_change(r["summary"]["primed"], r["summary"]["after"], k) for k in KEYS},
            "prime_only": ({k: r["baseline"]["prime_only"][k] for k in keep}
                           | {"steps": r["baseline"]["priming"]["steps"],
                              "budget_seconds": r["baseline"]["budget_seconds"]}) if r["baseline"] else None}
           for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python -m bench.seeds_table " + " ".join(map(str, args.runs)),
                                    "runs": out}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
