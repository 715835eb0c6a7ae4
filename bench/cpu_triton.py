"""Should the CPU install set carry triton? (issue 31 §2) What it costs to install, and what the unsloth backend's
GRPO steps cost through unsloth's patched `UnslothGRPOTrainer` (triton present) against TRL's own `GRPOTrainer`
(the CPU set as shipped), in the same venv and the same run.

    python -m bench.cpu_triton [--preset smollm2_cpu] [--steps 4] [--out bench/results/cpu_triton.json]

Run it in the CPU set's venv (requirements-cpu.txt). It installs the GPU set's triton pin (requirements.txt's
resolution: `pip install --no-deps --target DIR triton==VERSION`) into a folder of its own, timing it and
measuring its size; then trains the same unsloth-backend run twice in fresh processes: without that folder
(stock TRL: `unsloth.models.rl` cannot import without triton, so nothing patches TRL) and with it on PYTHONPATH
(unsloth patches TRL: the log names `UnslothGRPOTrainer`). Each run's GRPO seconds per step come from its own
summary.json (`train_seconds`, which counts the trainer's construction: the patched one compiles its cache
once); the ratio is patched / stock. The install time depends on pip's cache and the index's speed: the
report says which (a warm cache reads a local wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, command_line, machine, write_report

TRITON = "3.9.0"  # what `pip install -r requirements.txt` resolves triton to (torch 2.13.0's pin)


def install_triton(target: Path) -> dict:
    started = time.time()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    f"triton=={TRITON}"], check=True, capture_output=True, text=True)
    seconds = time.time() - started
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return {"version": TRITON, "install_s": round(seconds, 1), "installed_mb": round(size / 1e6)}


def train(preset: str, steps: int, workdir: Path, pythonpath: list[str]) -> dict:
    out = workdir / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO)])}
    cmd = [sys.executable, "-m", "lowvram_grpo.run", "--preset", preset, "--backend", "unsloth", "--max-steps",
           str(steps), "--set", "prime.steps=0", "--set", "eval.enabled=false", "--set", f"train.save_steps={steps}",
           "--output-dir", str(out)]
    print(f"[bench] {' '.join(cmd[2:])} (PYTHONPATH +{len(pythonpath)}) ...", file=sys.stderr, flush=True)
    started = time.time()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    wall = time.time() - started
    if proc.returncode != 0:
        sys.exit(f"error: the run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("GRPO as the trainer runs it: "))
    trainer = line.split("trainer=")[1].split()[0]
    summary = json.loads((out / "summary.json").read_text())
    return {"trainer": trainer, "steps": steps, "train_s": summary["train_seconds"],
            "train_s_per_step": round(summary["train_seconds"] / steps, 2), "wall_s": round(wall, 1),
            "settings_line": line}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_triton")
    parser.add_argument("--preset", default="smollm2_cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_triton.json")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="cpu-triton-"))
    try:
        triton = install_triton(root / "triton")
        stock = train(args.preset, args.steps, _fresh(root / "stock"), [])
        patched = train(args.preset, args.steps, _fresh(root / "patched"), [str(root / "triton")])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if stock["trainer"] == patched["trainer"]:
        sys.exit(f"error: both runs trained with {stock['trainer']}: triton did not change the trainer")
    report = {"command": command_line("bench.cpu_triton"), "machine": machine(), "triton": triton,
              "stock": stock, "patched": patched,
              "patched_vs_stock": {"train_s_per_step": round(patched["train_s_per_step"] / stock["train_s_per_step"],
                                                             3)}}
    write_report(args.out, report)
    print(json.dumps({k: report[k] for k in ("triton", "patched_vs_stock")}, indent=1))
    print(f"stock {stock['trainer']}: {stock['train_s_per_step']} s/step; patched {patched['trainer']}: "
          f"{patched['train_s_per_step']} s/step")
    return 0


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
