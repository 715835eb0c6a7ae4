"""Benchmark: a sampled generate call that merges the adapter against one that reuses the merged copies.

    flock /tmp/lowvram-cpu.lock python -m bench.merge_reuse     # writes bench/results/merge_reuse.json
    python -m bench.merge_reuse --tokens 8 --repeats 5 --out X.json

The default preset's model and rollout batch (bench/decode_step.rollout_batch), on the settings resolve()
decides here (the fused layers with the adapter merged, on a bf16 CPU). Two ways to make the same call, alternated,
best of `--repeats` each, in one process:

- `merge`: fused_decode's held copies dropped before the call, so it merges the adapter first: what every sampled
  call did before the copies were reused, and what the first call after an optimizer step does.
- `reuse`: the copies held from the call before (the adapter unchanged): what dynamic sampling's later draws and a
  tool run's later turns in the same GRPO step do now.

Both sample the same tokens (checked). The report gives each call's ms, the merge's share and `reuse` / `merge`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.harness import REPO, command_line, machine, write_report

OUT = REPO / "bench" / "results" / "merge_reuse.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2_cpu")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens a call (default 16: a tool turn's size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE settings")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    import torch

    from bench.decode_step import rollout_batch
    from lowvram_grpo.model import fused_decode
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect

    config = load_config(args.preset, args.set)
    resolved, handle, encoded = rollout_batch(config, detect())
    model, tokenizer = handle.model, handle.tokenizer
    inner = model.get_base_model()

    def call(drop: bool):
        if drop:
            fused_decode._MERGED.pop(inner, None)
        torch.manual_seed(0)
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=args.tokens, do_sample=True,
                                 temperature=config.train.temperature, top_p=config.train.top_p, top_k=0,
                                 pad_token_id=tokenizer.pad_token_id)
        return time.perf_counter() - started, out

    call(True)  # warm-up
    merge, reuse, same = [], [], True
    for _ in range(args.repeats):
        seconds, merged_out = call(True)
        merge.append(seconds)
        seconds, reused_out = call(False)
        reuse.append(seconds)
        same = same and torch.equal(merged_out, reused_out)
    best_merge, best_reuse = min(merge), min(reuse)
    report = {
        "what": "a sampled generate call of the default rollout batch: merging the adapter first against reusing the "
                "merged copies (fused_decode.merged_copies), best of the repeats, alternated in one process",
        "command": command_line("bench.merge_reuse"), "machine": machine(), "decode": resolved.decode.describe(),
        "batch": list(encoded["input_ids"].shape), "new_tokens": args.tokens,
        "merge_ms": round(best_merge * 1e3, 3), "reuse_ms": round(best_reuse * 1e3, 3),
        "merge_share": round((best_merge - best_reuse) / best_merge, 3),
        "reuse_vs_merge": round(best_reuse / best_merge, 3), "same_tokens": same,
        "all_ms": {"merge": [round(s * 1e3, 1) for s in merge], "reuse": [round(s * 1e3, 1) for s in reuse]},
    }
    write_report(args.out, report)
    print(f"[bench] merge {best_merge * 1e3:.1f} ms, reuse {best_reuse * 1e3:.1f} ms "
          f"({best_reuse / best_merge:.2f}x; same tokens: {same}) -> {args.out}", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
