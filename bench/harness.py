"""What the benches share: each variant in a fresh Python process that writes its result as JSON, peak
RSS, ratios against a peer measured in the same run, and the report written where docs/ reads it.

    result = run_child("bench.vs_trl", ["--child", "trl", "--preset", "tiny"], label="trl")  # + wall_s
    write_report(out, {"command": command_line("bench.vs_trl"), **results, "ratios_vs_trl": ratios(...)})
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    return {name: {key: round(r[key] / ref[key], 3) for key in keys} for name, r in results.items() if name != reference}


def command_line(module: str) -> str:
    return f"python -m {module} " + " ".join(sys.argv[1:])


def machine() -> dict:
    return {"cores": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]}


def write_report(out: Path, report: dict) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
