"""The adapter guard on normal runs (issue 66): it never fires, and what its scoring costs.

    python -m bench.adapter_guard seeds [--seeds 3407,1,2] [--steps 12]
    python -m bench.adapter_guard cost [--seed 3407] [--steps 3] [--prime-steps 2]

`seeds`: the default job (the smollm2_cpu preset: its priming, then GRPO with train.adapter_check_every=1 and
train.adapter_guard_steps=3, the defaults) for its first `--steps` GRPO steps on each seed (train.seed), the held-out
measures off (eval.enabled=false: the guard watches GRPO only). Each GRPO step's rollouts are scored under the adapter
and the base (sampling/adapter_minus_base_logp/mean; the sampler's own log-probs' distance to the base's and to the
adapter's); the record keeps those per step, the steps the guard flagged (sampling/adapter_skipped) and whether the run
stopped, and the seconds of the scoring's own passes (sampling/adapter_check_seconds: the base's no-grad forward; the
adapter's side is the loss's forward) against GRPO's. One JSON a seed in bench/results/adapter_guard/.

`cost`: the same job shortened (`--prime-steps` priming steps, `--steps` GRPO steps) with the scoring off
(train.adapter_check_every=0) and on (1, the default), one process each: every metrics.jsonl field but the timings
must be identical (the extra scoring leaves the RNG and the loss alone), and the GRPO seconds of the two give its cost.

Timed figures: run alone (`flock /tmp/lowvram-cpu.lock python -m bench.adapter_guard ...`), on the machine the
record names.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.harness import machine, run_cli, write_report
from lowvram_grpo.report.learning_signals import (
    ADAPTER_SKIPPED_KEY,
    ADAPTER_VS_BASE_KEY,
    SAMPLER_BASE_GAP_KEY,
    SAMPLER_GAP_KEY,
)

ROOT = Path("runs/adapter_guard")
OUT = Path("bench/results/adapter_guard")
TIMING = ("second", "time", "rss", "memory", "runtime", "per_second")
CHECK_SECONDS = "sampling/adapter_check_seconds"  # trl_compat.ADAPTER_CHECK_SECONDS_KEY: the scoring's own passes
KEPT = (ADAPTER_VS_BASE_KEY, SAMPLER_BASE_GAP_KEY, SAMPLER_GAP_KEY, ADAPTER_SKIPPED_KEY, CHECK_SECONDS)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _job(run: Path, seed: int, sets: list[str], log: Path) -> tuple[list[str], float]:
    argv = ["lowvram_grpo.run", "--preset", "smollm2_cpu", "--output-dir", str(run), "--overwrite",
            *[item for s in ["eval.enabled=false", f"train.seed={seed}", *sets] for item in ("--set", s)]]
    wall, _ = run_cli(argv, log)
    return argv, wall


def seeds(args) -> int:
    for seed in args.seeds:
        run = ROOT / f"seed{seed}"
        run.parent.mkdir(parents=True, exist_ok=True)
        argv, wall = _job(run, seed, [f"train.max_steps={args.steps}"], run.parent / f"seed{seed}.log")
        rows = _rows(run)
        summary = json.loads((run / "summary.json").read_text())
        steps = [{"step": r["step"], **{k: r.get(k) for k in KEPT}} for r in rows]
        flagged = [s["step"] for s in steps if s[ADAPTER_SKIPPED_KEY] == 1.0]
        record = {
            "seed": seed, "grpo_steps": len(rows), "status": summary.get("status"),
            "guard_fired": bool(flagged), "flagged_steps": flagged,
            "judged_steps": sum(1 for s in steps if s[ADAPTER_SKIPPED_KEY] is not None),
            "adapter_minus_base_min": min(s[ADAPTER_VS_BASE_KEY] for s in steps),
            "sampler_closer_to_adapter_by_min": min(s[SAMPLER_BASE_GAP_KEY] - s[SAMPLER_GAP_KEY] for s in steps
                                                    if s[SAMPLER_BASE_GAP_KEY] is not None),
            "check_seconds": round(sum(s[CHECK_SECONDS] or 0.0 for s in steps), 2),
            "check_share_of_grpo": round(sum(s[CHECK_SECONDS] or 0.0 for s in steps) / summary["train_seconds"], 4),
            "steps": steps, "train_seconds": summary.get("train_seconds"), "wall_seconds": wall,
            "command": "python -m " + " ".join(argv), "machine": machine(),
        }
        path = write_report(OUT / f"seed{seed}.json", record)
        print(f"seed {seed}: {len(rows)} GRPO steps, guard fired: {bool(flagged)} {flagged}; "
              f"adapter - base >= {record['adapter_minus_base_min']:.4f} nats a token; the scoring's passes "
              f"{record['check_share_of_grpo']:.1%} of GRPO's seconds -> {path}", flush=True)
    return 0


def cost(args) -> int:
    sets = [f"train.max_steps={args.steps}", f"prime.steps={args.prime_steps}", "train.save_steps=100"]
    runs, record = {}, {"seed": args.seed, "grpo_steps": args.steps, "prime_steps": args.prime_steps, "runs": {}}
    for every in (0, 1):
        run = ROOT / f"cost_every{every}"
        run.parent.mkdir(parents=True, exist_ok=True)
        argv, wall = _job(run, args.seed, [*sets, f"train.adapter_check_every={every}"],
                          run.parent / f"cost_every{every}.log")
        rows = _rows(run)
        runs[every] = rows
        record["runs"][f"adapter_check_every={every}"] = {
            "train_seconds": json.loads((run / "summary.json").read_text())["train_seconds"], "wall_seconds": wall,
            "command": "python -m " + " ".join(argv)}
    off, on = runs[0], runs[1]
    same = [{k: v for k, v in a.items() if not any(t in k.lower() for t in TIMING)} for a in off]
    compared = [{k: v for k, v in b.items() if k in a and not any(t in k.lower() for t in TIMING)}
                for a, b in zip(same, on)]
    record["non_timing_fields_identical"] = len(off) == len(on) and same == compared
    record["fields_compared"] = sorted(same[0]) if same else []
    seconds = [record["runs"][k]["train_seconds"] for k in ("adapter_check_every=0", "adapter_check_every=1")]
    record["grpo_seconds_ratio_on_off"] = round(seconds[1] / seconds[0], 3)
    record["machine"] = machine()
    path = write_report(OUT / f"cost_seed{args.seed}.json", record)
    print(f"identical non-timing fields: {record['non_timing_fields_identical']}; GRPO seconds off {seconds[0]} on "
          f"{seconds[1]} ({record['grpo_seconds_ratio_on_off']}x) -> {path}")
    return 0 if record["non_timing_fields_identical"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adapter_guard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("seeds")
    s.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[3407, 1, 2])
    s.add_argument("--steps", type=int, default=12)
    c = sub.add_parser("cost")
    c.add_argument("--seed", type=int, default=3407)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--prime-steps", type=int, default=2)
    args = parser.parse_args(argv)
    return seeds(args) if args.command == "seeds" else cost(args)


if __name__ == "__main__":
    sys.exit(main())
