"""Issue 32's table: does GRPO raise tool use and accuracy with the calculator, and is the model better with the
tool than without it? `smollm2_tools_cpu` (SmolLM2-135M, the built-in word problems, the built-in calculator), per seed.

    python -m bench.tools_table run --seed 3407 --root runs/tools    # one seed
    python -m bench.tools_table table                                # docs/results.md's table, from the JSON

`run` does, for one seed, each step only if its result is not there yet (so a stopped seed goes on):
1. the preset as a user runs it: priming on transcripts that call the calculator, then multi-turn GRPO with it;
   before / primed / after measured with the tool (greedy, multi-turn), in ROOT/tools-S;
2. `lowvram-grpo eval --adapter primed=ROOT/tools-S/primed_adapter --adapter after=ROOT/tools-S/adapter --set
   tools.names=[] --json`: the base model and both adapters without the tool (one turn, no schema in the prompt),
   on the same questions, paired with the run's own columns with the tool (per-question verdicts). The same as
   `--without-tools`, less the with-tool columns the run has already measured.
Every step is a real command (subprocess, the CLI a user types); the seed's numbers go to
bench/results/tools/seed-S.json (accuracy, format, tool calls per answer, answers with calls, calls that ran,
paired changes), so `table` needs only the committed JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from bench.harness import accuracy_cell, paired_cell, run_cli, seed_table_parser
from lowvram_grpo.evaluate.evaluation import mcnemar_p, paired_change
from lowvram_grpo.report.run_dir import RunDir

OUT = Path("bench/results/tools")
PRESET = "smollm2_tools_cpu"
KEEP = ("accuracy_strict", "accuracy_strict_ci", "accuracy_lenient", "format_rate", "mean_completion_tokens", "tools",
        "n")


def _column(numbers: dict) -> dict:
    return {k: numbers[k] for k in KEEP if k in numbers}


def run_seed(seed: int, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"seed-{seed}.json"
    record = json.loads(out.read_text()) if out.is_file() else {"seed": seed, "preset": PRESET}
    run = root / f"tools-{seed}"

    def save():
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", flush=True)

    if "run" not in record:
        argv = ["lowvram_grpo.run", "--preset", PRESET, "--set", f"train.seed={seed}", "--set",
                f"lora.random_state={seed}", "--output-dir", str(run), "--overwrite"]
        wall, _ = run_cli(argv, root / f"tools-{seed}.log", stdout=True)
        s = RunDir(run, writer=False).complete_summary()
        record["run"] = {"command": "python -m " + " ".join(argv), "wall_seconds": wall, "steps": s["steps"],
                         "train_seconds": s["train_seconds"],
                         "priming_seconds": (s.get("priming") or {}).get("seconds"),
                         **{c: _column(s[c]) for c in ("before", "primed", "after")},
                         "grpo": {k: paired_change(s["primed"], s["after"], k)
                                  for k in ("accuracy_strict", "accuracy_lenient")}}
        save()
    if "without_tools" not in record:
        argv = ["lowvram_grpo.evaluate", "--adapter", f"primed={run / 'primed_adapter'}", "--adapter",
                f"after={run / 'adapter'}", "--set", "tools.names=[]", "--json"]
        wall, stdout = run_cli(argv, root / f"tools-{seed}-eval.log", stdout=True)
        plain = {c["name"]: c for c in json.loads(stdout)["columns"]}  # base, primed, after: no tool
        s = RunDir(run, writer=False).complete_summary()
        with_tool = {"base": s["before"], "primed": s["primed"], "after": s["after"]}
        record["without_tools"] = {
            "command": "lowvram-grpo eval " + " ".join(argv[1:]), "wall_seconds": wall,
            "columns": {name: _column(c) for name, c in plain.items()},
            "tool_vs_none": {name: paired_change(plain[name], with_tool[name], "accuracy_strict")
                             for name in ("base", "primed", "after")},
            "grpo_without_tools": paired_change(plain["primed"], plain["after"], "accuracy_strict")}
        save()
    return out


def _calls(col: dict) -> str:
    t = col.get("tools") or {}
    if not t:
        return "-"
    ran = t.get("ran_share")
    return f"{t['calls_per_answer']:.2f} / {t['answers_with_calls']:.2f} / {'-' if ran is None else f'{ran:.2f}'}"


def seed_records(out: Path = OUT) -> list[dict]:
    """The seeds' records under `out` (bench/results/tools, from the current folder), in numeric seed order."""
    return sorted((json.loads(p.read_text()) for p in out.glob("seed-*.json")), key=lambda r: r["seed"])


def table(records: list[dict]) -> str:
    lines = ["| seed | column | with the tool, strict [95 % CI] | calls per answer / answers with calls / ran | "
             "format | without the tool, strict | with the tool vs without (right/wrong, p) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        run, plain = r.get("run"), r.get("without_tools")
        if run is None:
            lines.append(f"| {r['seed']} | not run | | | | | |")
            continue
        for name in ("before", "primed", "after"):
            col = run[name]
            key = {"before": "base"}.get(name, name)
            without = (plain or {}).get("columns", {}).get(key)
            lines.append(f"| {r['seed']} | {name} | {accuracy_cell(col)} | {_calls(col)} | {col['format_rate']:.3f} | "
                         f"{accuracy_cell(without) if without else '-'} | "
                         f"{paired_cell((plain or {}).get('tool_vs_none', {}).get(key))} |")
        lines.append(f"| {r['seed']} | GRPO: primed -> after | {paired_cell(run['grpo']['accuracy_strict'])} | | | "
                     f"{paired_cell((plain or {}).get('grpo_without_tools'))} | |")
    done = [r for r in records if r.get("run") and r.get("without_tools")]
    if len(done) > 1:
        lines += _pooled(done)
    return "\n".join(lines)


def _sum(pairs: list) -> tuple[int, int, float]:
    """Paired changes of several seeds added up (each seed's questions counted once per seed), McNemar's p on the
    sums."""
    gained, lost = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return gained, lost, mcnemar_p(gained, lost)


def _pooled(records: list[dict]) -> list[str]:
    """Rows over the seeds: mean accuracy and format per column, paired changes added up."""
    n = len(records)
    mean = lambda values: sum(values) / n  # noqa: E731
    rows = []
    for name in ("before", "primed", "after"):
        key = {"before": "base"}.get(name, name)
        cols = [r["run"][name] for r in records]
        plain = [r["without_tools"]["columns"][key] for r in records]
        calls = [(c.get("tools") or {}).get("calls_per_answer", 0.0) for c in cols]
        rows.append(f"| {n} seeds | {name} | {mean([c['accuracy_strict'] for c in cols]):.3f} (mean) | "
                    f"{mean(calls):.2f} calls per answer (mean) | {mean([c['format_rate'] for c in cols]):.3f} | "
                    f"{mean([c['accuracy_strict'] for c in plain]):.3f} (mean) | "
                    f"{paired_cell(_sum([r['without_tools']['tool_vs_none'][key] for r in records]))} |")
    rows.append(f"| {n} seeds | GRPO: primed -> after | "
                f"{paired_cell(_sum([r['run']['grpo']['accuracy_strict'] for r in records]))} | | | "
                f"{paired_cell(_sum([r['without_tools']['grpo_without_tools'] for r in records]))} | |")
    return rows


def main(argv=None) -> int:
    parser, _ = seed_table_parser("bench.tools_table", __doc__, OUT, Path("runs/tools"))
    args = parser.parse_args(argv)
    if args.what == "run":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        run_seed(args.seed, args.root)
        return 0
    print(table(seed_records()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
