"""Benchmark: one optimizer step over the default job's LoRA parameters on this CPU, 8-bit AdamW against torch's.

    python -m bench.optimizer_step                  # writes bench/results/optimizer_step.json
    python -m bench.optimizer_step --repeats 20 --out /tmp/opt.json

The parameters are the shapes of LoRA r=16 on all seven projections of SmolLM2-135M-Instruct (30 layers, hidden
576, intermediate 1536, 3 KV heads of 64: 4.88M parameters, float32 as the run keeps them), with random gradients.
Each optimizer is the class transformers builds for `train.optim`: bitsandbytes' AdamW8bit (adamw_8bit, what
paged_adamw_8bit is on a CPU), torch's AdamW (adamw_torch) and its fused form (adamw_torch_fused, TRL's default).
The optimizers' steps are interleaved (A B C A B C ...) so a load that changes over the run touches each alike;
the first step of each (state allocation) is not counted. Records the median and every step's milliseconds, the
state's bytes, the machine and the load average before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import command_line, machine, write_report

LAYERS, HIDDEN, INTERMEDIATE, KV = 30, 576, 1536, 192
RANK = 16
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),      # q, k, v, o: (in, out)
          (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # gate, up, down


def lora_parameters(torch):
    """LoRA A (r x in) and B (out x r) of every projection of every layer, float32, with random gradients."""
    generator = torch.Generator().manual_seed(0)
    params = []
    for _ in range(LAYERS):
        for fan_in, fan_out in SHAPES:
            for shape in ((RANK, fan_in), (fan_out, RANK)):
                p = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.01)
                p.grad = torch.randn(shape, generator=generator) * 1e-3
                params.append(p)
    return params


def build(name: str, params, torch):
    if name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4, fused=name == "adamw_torch_fused")


def state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if hasattr(v, "element_size"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=12, help="counted steps per optimizer")
    p.add_argument("--optimizers", default="adamw_8bit,adamw_torch,adamw_torch_fused")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "optimizer_step.json")
    args = p.parse_args()
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    import torch

    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    load_before = os.getloadavg()
    runs = {}
    for name in names:
        params = lora_parameters(torch)
        runs[name] = (params, build(name, params, torch), [])
        runs[name][1].step()  # the first step allocates the state: not counted
    for _ in range(args.repeats):
        for name in names:
            _, optimizer, times = runs[name]
            started = time.perf_counter()
            optimizer.step()
            times.append((time.perf_counter() - started) * 1000)
    count = sum(p.numel() for p in runs[names[0]][0])
    results = {name: {"median_ms": round(statistics.median(times), 2), "all_ms": [round(t, 2) for t in times],
                      "state_mb": round(state_bytes(optimizer) / 1e6, 1)}
               for name, (_, optimizer, times) in runs.items()}
    reference = results.get("adamw_torch")
    if reference:
        for r in results.values():
            r["time_vs_adamw_torch"] = round(r["median_ms"] / reference["median_ms"], 2)
    report = {"command": command_line("bench.optimizer_step"), "lora_parameters": count, **machine(),
              "torch_threads": torch.get_num_threads(), "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "results": results}
    write_report(args.out, report)
    for name, r in results.items():
        print(f"{name}: {r['median_ms']} ms a step (state {r['state_mb']} MB)")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
