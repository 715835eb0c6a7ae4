"""What the benches share: each variant in a fresh Python process that writes its result as JSON, peak
RSS, ratios against a peer measured in the same run, and the report written where docs/ reads it.

    result = run_child("bench.vs_trl", ["--child", "trl", "--preset", "tiny"], label="trl")  # + wall_s
    write_report(out, {"command": command_line("bench.vs_trl"), **results, "ratios_vs_trl": ratios(...)})

A bench of variants (vs_trl, vllm_cpu) is `variant_parser` + `bench_variants`: the parent runs each variant as
`python -m bench.NAME --child VARIANT ... --result FILE`, the child runs one. The per-seed tables (tools_table,
variants_table) share `run_cli` and the table cells `accuracy_cell` / `paired_cell`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowvram_grpo.core.cpu import cpu_flags

REPO = Path(__file__).resolve().parent.parent  # run as `python -m bench.NAME` from the checkout


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss, KiB on Linux) in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(module: str, args: list[str], label: str, env: "dict | None" = None) -> dict:
    """`python -m MODULE ARGS --result FILE` in a fresh process (so peak memory is the variant's alone), from
    the checkout; returns the JSON the child wrote with `write_child_result`, plus `wall_s`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_path = Path(fh.name)
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    started = time.time()
    try:
        subprocess.run([sys.executable, "-m", module, *args, "--result", str(result_path)], cwd=REPO, check=True,
                       env=env)
        result = json.loads(result_path.read_text())
    finally:
        result_path.unlink(missing_ok=True)
    result["wall_s"] = round(time.time() - started, 1)
    return result


def write_child_result(path, result: dict) -> None:
    Path(path).write_text(json.dumps(result))


def ratios(results: dict, reference: str, keys: tuple[str, ...]) -> dict:
    """{variant: {key: variant's value / the reference's}} for every other variant of the same run."""
    ref = results[reference]
    return {name: {key: round(r[key] / ref[key], 3) for key in keys}
            for name, r in results.items() if name != reference}


def command_line(module: str) -> str:
    return f"python -m {module} " + " ".join(sys.argv[1:])


ISA_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vp2intersect", "avx512_vnni", "amx_bf16",
             "amx_int8", "avx_vnni"}


def machine() -> dict:
    """The machine a figure came from: cores, CPU model, whether it computes bf16 natively (AVX512-BF16 or AMX:
    bf16 runs; else float32, ~3x slower steps), the ISA flags that tell CPU generations with the same model name
    apart (two "AMD EPYC" machines of this workplace differ ~2x in step time), Python."""
    model, flags = "", cpu_flags()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    except OSError:  # not Linux
        pass
    return {"cores": len(os.sched_getaffinity(0)), "cpu": model or None,
            "bf16_native": bool(flags & {"avx512_bf16", "amx_bf16"}) if flags else None,
            "isa": sorted(flags & ISA_FLAGS),
            "python": sys.version.split()[0]}


def write_report(out: Path, report: dict) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------- a bench of variants, parent and child


def variant_parser(doc: str, variants: str, steps: int, generations: int, out: Path) -> argparse.ArgumentParser:
    """The arguments every variant bench takes (a bench adds its own after): which variants, the run's shape,
    `--set` overrides for every variant, where the report goes, and the hidden `--child` / `--result` pair."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--variants", default=variants, help="comma-separated: " + variants.replace(",", ", "))
    p.add_argument("--preset", default="smollm2_cpu")
    p.add_argument("--steps", type=int, default=steps, help="GRPO steps per variant; the first is not counted")
    p.add_argument("--generations", type=int, default=generations, help="completions per prompt (G)")
    p.add_argument("--tokens", type=int, default=64, help="max completion tokens (L)")
    p.add_argument("--set", action="append", help="extra config override for every variant")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--rounds", type=int, default=1, help="run the variants this many times, each round in the order "
                   "opposite the last's (A B, then B A): a variant's figures are the median over its rounds, each "
                   "round's record kept")
    p.add_argument("--once", default="", help="comma-separated variants run in the first round only (one far slower "
                   "than the rest, whose order decides nothing): its record says so")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def child_argv(variant: str, args, extra: tuple[str, ...] = ()) -> list[str]:
    """The child's command line: the variant, the shared shape (+ the bench's own `extra` argument names), `--set`s."""
    argv = ["--child", variant]
    for name in ("preset", "steps", "generations", "tokens", *extra):
        argv += [f"--{name}", str(getattr(args, name))]
    for assignment in args.set or []:
        argv += ["--set", assignment]
    return argv


def combine_rounds(records: list[dict], memory_key: str) -> dict:
    """One variant's figures over its rounds: the first round's record with step_s and each of parts_s the median
    over the rounds, the `memory_key` the highest; with more than one round, each round's record under `rounds`
    (its round, its position in that round's order, the order, its step_s, parts and memory). One round: as run."""
    if len(records) == 1:
        return records[0]
    combined = dict(records[0])
    combined["step_s"] = round(statistics.median(r["step_s"] for r in records), 3)
    if isinstance(records[0].get("parts_s"), dict):
        combined["parts_s"] = {part: round(statistics.median(r["parts_s"][part] for r in records), 3)
                               for part in records[0]["parts_s"]}
    combined[memory_key] = max(r[memory_key] for r in records)
    keep = ("round", "position", "order", "step_s", "parts_s", memory_key, "all_steps_s", "wall_s")
    combined["rounds"] = [{k: r[k] for k in keep if k in r} for r in records]
    return combined


def bench_variants(module: str, args, child, table, memory: tuple[str, str], references: tuple[str, ...],
                   extra: tuple[str, ...] = (), headline=None) -> int:
    """A child (`--child`): `child(variant, args)`'s result written for the parent. The parent: each variant of
    `--variants` in its own process (`--rounds` times, each round in the order opposite the last's), the report
    (settings with the load average before and after, results, ratios against each of `references` run, on step_s
    and the `memory` key, and what `headline(results)` adds) written to `--out`, `table(results)` printed.
    `memory`: (its label, its key)."""
    if args.child:
        write_child_result(args.result, child(args.child, args))
        return 0
    label, key = memory
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    load_before = os.getloadavg()
    once = {v.strip() for v in (getattr(args, "once", "") or "").split(",") if v.strip()}

    def report_so_far(complete: bool) -> dict:
        results = {variant: combine_rounds(records, key) for variant, records in runs.items() if records}
        report = {
            "command": command_line(module),
            "complete": complete,  # False: written after a variant's run, the invocation still going (or cut short)
            "settings": {"preset": args.preset, "model": "SmolLM2-135M-Instruct", "generations": args.generations,
                         "max_completion_tokens": args.tokens, "steps": args.steps,
                         "counted_steps": max(1, args.steps - 1), "rounds": max(1, getattr(args, "rounds", 1)),
                         "first_round_only": sorted(once), **machine(), "extra": args.set or [],
                         "loadavg_before": [round(x, 2) for x in load_before],
                         "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
            **results,
        }
        for ref in references:
            if ref in results:
                report[f"ratios_vs_{ref}"] = ratios(results, ref, ("step_s", key))
        if headline is not None:
            report.update(headline(results))
        return report

    for round_index in range(max(1, getattr(args, "rounds", 1))):
        order = variants if round_index % 2 == 0 else variants[::-1]
        order = order if round_index == 0 else [v for v in order if v not in once]
        for position, variant in enumerate(order):
            r = run_child(module, child_argv(variant, args, extra), f"{variant}: {args.steps} steps")
            runs[variant].append({**r, "round": round_index + 1, "position": position + 1, "order": ",".join(order)})
            print(f"[bench] {variant}: {r['step_s']} s/step, {label} {r[key]} MB", file=sys.stderr)
            write_report(args.out, report_so_far(complete=False))  # what has run survives a cut
    report = report_so_far(complete=True)
    results = {variant: report[variant] for variant in variants if variant in report}
    write_report(args.out, report)
    print(table(results))
    print(f"\nwritten: {args.out}")
    return 0


# --------------------------------------------------------------------------- the per-seed tables (tools, variants)


def run_cli(argv: list[str], log: Path, stdout: bool = False) -> "tuple[float, str | None]":
    """`python -m ARGV` to its end, stderr (and stdout, unless `stdout`: then it is returned) into `log`; its wall
    seconds and stdout. A failure stops the bench with one line naming the log."""
    print("$ " + " ".join(argv), flush=True)
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", *argv], stdout=subprocess.PIPE if stdout else out,
                              stderr=out if stdout else subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        print(f"error: `{' '.join(argv)}` exited {proc.returncode}; its output: {log}", file=sys.stderr)
        raise SystemExit(1)
    return round(time.time() - started, 1), proc.stdout


def seed_table_parser(module: str, doc: str, out: Path,
                      root: Path) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """`python -m MODULE run --seed S [--root ROOT]` (one seed, each step only if its result is not there yet) and
    `python -m MODULE table` (the docs' table from OUT/seed-*.json); the parser and its `run` subparser."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("run", help="run (or finish) one seed")
    one.add_argument("--seed", type=int, required=True)
    one.add_argument("--root", type=Path, default=root)
    sub.add_parser("table", help=f"print the table from {out}/seed-*.json")
    return parser, one


def accuracy_cell(col: dict, key: str = "accuracy_strict") -> str:
    """`0.453 [0.37, 0.54]`: an accuracy and its 95 % interval."""
    lo, hi = col[f"{key}_ci"]
    return f"{col[key]:.3f} [{lo:.2f}, {hi:.2f}]"


def paired_cell(got) -> str:
    """`+36/-11 (p < 0.001)`: a paired change (newly right, newly wrong, McNemar p), or `-` without one."""
    if not got:
        return "-"
    p = got[2]
    return f"+{got[0]}/-{got[1]} (p {'< 0.001' if p < 0.001 else f'{p:.3f}'})"
