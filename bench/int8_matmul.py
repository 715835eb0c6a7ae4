"""Which int8 matmul reads a decode step's weights faster than bf16 on this CPU (issue 51's cheaper rollouts)?

    flock /tmp/lowvram-cpu.lock python -m bench.int8_matmul [--rows 4,16] [--out bench/results/int8_matmul.json]

A decode step of the fused layers (model/fused_decode.py) is, per layer, four matmuls of [rows, in] activations with
the merged weights (q/k/v fused, o, gate/up fused, down), then the LM head; the profile puts most of a token step in
them. Each candidate computes those products for SmolLM2-135M's shapes (read from the built-in checkpoint's config,
random values) at the rollout's row counts:

- `bf16`: F.linear on bf16 weights (what the fused layers run today);
- `int8_weight_only`: torch's `aten._weight_int8pack_mm` (int8 weights with a bf16 scale per output row, bf16
  activations; gpt-fast's and torchao's CPU weight-only path): half the weight bytes;
- `int8_dynamic_fbgemm`: torch's quantized dynamic linear (`quantized::linear_dynamic` on a prepacked per-channel
  int8 weight; the activations quantized per call, to 7 bits on a CPU without VNNI where 8 saturate, fp32 in and
  out; FBGEMM's kernels);
- `int8_int_mm`: `torch._int_mm` of per-row int8 activations with the int8 weights, rescaled in fp32.

For each: the time of one token step's products (every layer with its own weights, so no more of them stay in the
CPU's caches than in a real decode step; best of 10 after 2 warm-ups), its ratio to bf16, and each product's
relative error against an fp32 product (mean |out - ref| / mean |ref|). Timed: run it alone, on the machine the
docs name.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import machine
from lowvram_grpo.core.commands import ArgumentParser
from lowvram_grpo.core.internals import int8_saturates


def shapes() -> list[tuple[str, int, int, int]]:
    """(name, out, in, how many a token step) of the fused layers' products and the LM head, SmolLM2-135M."""
    from lowvram_grpo.settings.model_shapes import model_shape

    s = model_shape("builtin:smollm2")
    layers = s.layers
    return [("qkv", s.q_dim + 2 * s.kv_dim, s.hidden, layers), ("o", s.hidden, s.q_dim, layers),
            ("gate_up", 2 * s.intermediate, s.hidden, layers), ("down", s.hidden, s.intermediate, layers),
            ("head", s.vocab, s.hidden, 1)]


def candidates(weight):
    """{name: fn(x bf16 [rows, in]) -> [rows, out]} for one bf16 weight [out, in]."""
    import torch
    import torch.nn.functional as F

    w32 = weight.float()
    scale = w32.abs().amax(1).clamp(min=1e-8) / 127                                     # [out]
    q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)               # [out, in]
    q_t = q.t()                                                                          # [in, out], a view
    scale_bf16 = scale.to(torch.bfloat16)
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(w32, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8), None)

    def int_mm(x):
        xf = x.float()
        xs = xf.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127                        # [rows, 1]
        xq = torch.round(xf / xs).to(torch.int8)
        return (torch._int_mm(xq, q_t).float() * xs * scale).to(torch.bfloat16)

    return {
        "bf16": lambda x: F.linear(x, weight),
        "int8_weight_only": lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale_bf16),
        "int8_dynamic_fbgemm": lambda x: torch.ops.quantized.linear_dynamic(x.float(), packed, int8_saturates()),
        "int8_int_mm": int_mm,
    }


def measure(rows: int, passes: int = 10) -> dict:
    """One token step's products on distinct weights (every layer its own, as in the model, so the caches hold no
    more of them than in a real decode step), per candidate: the best of `passes` timed token steps after 2 warm-ups,
    and each product's relative error against fp32 (first layer)."""
    import torch

    torch.manual_seed(0)
    weights = [(name, [(torch.randn(out, inp) * inp ** -0.5).to(torch.bfloat16) for _ in range(count)])
               for name, out, inp, count in shapes()]
    inputs = {name: torch.randn(rows, ws[0].shape[1]).to(torch.bfloat16) for name, ws in weights}
    names = list(candidates(weights[0][1][0]))
    step_ms, errors = {}, {}
    for cand in names:
        fns = [(name, [candidates(w)[cand] for w in ws]) for name, ws in weights]
        with torch.no_grad():
            def token_step():
                for name, per_layer in fns:
                    for fn in per_layer:
                        fn(inputs[name])
            for _ in range(2):
                token_step()
            best = float("inf")
            for _ in range(passes):
                start = time.perf_counter()
                token_step()
                best = min(best, time.perf_counter() - start)
            step_ms[cand] = round(best * 1e3, 2)
            for (name, per_layer), (_, ws) in zip(fns, weights):
                ref = inputs[name].float() @ ws[0].float().t()
                err = ((per_layer[0](inputs[name]).float() - ref).abs().mean() / ref.abs().mean()).item()
                errors.setdefault(cand, {})[name] = round(err, 5)
    return {"rows": rows, "token_step_ms": step_ms,
            "vs_bf16": {k: round(v / step_ms["bf16"], 3) for k, v in step_ms.items()},
            "relative_error": errors}


def row_counts(text: str) -> list[int]:
    """--rows: positive whole numbers, comma-separated ("4,16")."""
    try:
        rows = [int(part) for part in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"takes positive whole numbers separated by commas (4,16), got {text!r}")
    return rows


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m bench.int8_matmul", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=row_counts, default=[4, 16],
                        help="activation rows (the rollout batch): comma list")
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8_matmul.json"))
    args = parser.parse_args(argv)
    import torch

    report = {"command": "python -m bench.int8_matmul " + " ".join(argv or []), "machine": machine(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "results": [measure(r) for r in args.rows]}
    for r in report["results"]:
        print(f"{r['rows']} rows: token step matmuls " + ", ".join(
            f"{k} {v} ms ({r['vs_bf16'][k]}x)" for k, v in r["token_step_ms"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
