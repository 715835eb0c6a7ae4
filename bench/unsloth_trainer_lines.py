"""Which lines of unsloth's generated GRPO trainer run on this machine, and which only a GPU runs.

    python -m bench.unsloth_trainer_lines [--steps 3] [--out bench/results/unsloth_trainer_lines.json]

In the GPU install set (requirements.txt) on a CPU: trains a tiny run on the unsloth backend (through
`UnslothGRPOTrainer`, the class a GPU run gets: tests/test_unsloth_trainer.py) under coverage.py, limited to
`unsloth_compiled_cache/UnslothGRPOTrainer.py` (unsloth writes it into the working directory from the installed
TRL's source), then reads every `if` / conditional expression of that file whose test names the device
(cuda, xpu, DEVICE_TYPE, device.type, bf16 support, vLLM) and says, per branch, whether its body and its
else ran here. Writes the table as JSON and prints it as markdown (docs/gpu.md quotes it).

Needs coverage.py in the venv (`pip install coverage==7.13.0`; a measuring tool, not a dependency of the run).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = "unsloth_compiled_cache/UnslothGRPOTrainer.py"
DEVICE = re.compile(r"cuda|xpu|DEVICE_TYPE|device_type|device\.type|is_available|bf16_supported|use_vllm|vllm_mode"
                    r"|is_vLLM_available|mem_get_info|OutOfMemoryError|_is_cuda|\bnpu\b|\bmps\b")


def device_branches(source: str) -> list[dict]:
    """Every `if` statement / conditional expression whose test names the device: line, test, else line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp)):
            test = ast.get_source_segment(source, node.test) or ""
            if not DEVICE.search(test):
                continue
            body = node.body if isinstance(node, ast.If) else [node.body]
            orelse = node.orelse if isinstance(node, ast.If) else [node.orelse]
            found.append({"line": node.lineno, "test": " ".join(test.split())[:140],
                          "body_line": body[0].lineno if body else None,
                          "else_line": orelse[0].lineno if orelse else None,
                          "expression": isinstance(node, ast.IfExp)})
    return sorted(found, key=lambda b: b["line"])


def measure(steps: int, workdir: Path) -> tuple[Path, set[int], dict]:
    out = workdir / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "coverage", "run", f"--include=*/{TARGET}", "-m", "lowvram_grpo.run", "--preset",
           "tiny", "--backend", "unsloth", "--max-steps", str(steps), "--set", "train.save_steps=2",
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"error: the tiny unsloth run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    if "trainer=UnslothGRPOTrainer" not in proc.stdout:
        sys.exit("error: the run did not train through UnslothGRPOTrainer (not the GPU install set?)")
    subprocess.run([sys.executable, "-m", "coverage", "json", "-o", "cov.json"], cwd=workdir, check=True,
                   capture_output=True)
    files = json.loads((workdir / "cov.json").read_text())["files"]
    (name, data), = files.items()
    return workdir / TARGET, set(data["executed_lines"]), data["summary"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "unsloth_trainer_lines.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, executed, summary = measure(args.steps, Path(tmp))
        source = path.read_text()
    import torch
    import trl
    import unsloth

    branches = device_branches(source)
    for b in branches:
        b["test_ran"] = b["line"] in executed
        b["body_ran"] = b["body_line"] in executed if b["body_line"] else None
        b["else_ran"] = b["else_line"] in executed if b["else_line"] else None
    result = {"command": f"python -m bench.unsloth_trainer_lines --steps {args.steps}",
              "machine": f"CPU only, torch {torch.__version__}", "unsloth": unsloth.__version__,
              "trl": trl.__version__, "file_lines": len(source.splitlines()),
              "statements": summary["num_statements"], "statements_run": summary["covered_lines"],
              "branches": branches}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{TARGET}: {summary['covered_lines']} of {summary['num_statements']} statements ran "
          f"(unsloth {unsloth.__version__}, trl {trl.__version__}, a {args.steps}-step tiny run)")
    print("| line | condition | test ran | body ran | else ran |\n|---|---|---|---|---|")
    for b in branches:
        cell = {True: "yes", False: "no", None: "-"}
        print(f"| {b['line']} | `{b['test'].replace('|', '/')}` | {cell[b['test_ran']]} | {cell[b['body_ran']]} | "
              f"{cell[b['else_ran']]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
