"""Benchmark: one decode token step of the default preset's rollout batch against the weight-bandwidth floor.

    python -m bench.decode_step                 # writes bench/results/decode_step.json
    python -m bench.decode_step --out X.json --tokens 33

The default preset (smollm2_cpu: SmolLM2-135M-Instruct, bf16 on a CPU with AVX512-BF16, LoRA r=16 on all seven
projections) on the hf backend, its rollout batch (train.per_device_train_batch_size sequences: 2 prompts x 8
completions), sampled at its temperature. One process, one model; each variant is a `decode:` setting as
resolve() would hand it to decoding.install, so what is timed is what a run calls (model.generate):

- `transformers`: transformers' generate (decode.loop=transformers), the adapter unmerged: the plain path.
- `loop`, `loop+inverse_cdf`, `loop+inverse_cdf+merged`, `loop+inverse_cdf+merged+fused`: our loop, one lever more
  each; `loop+inverse_cdf+fused`: the fused layers with the adapter unmerged (decode.merge_lora=false: the base
  weights read in place, no merged copy); `...+fused+int8`: the fused layers on int8 weights (decode.weights=int8,
  opt-in; its once-per-call quantization cancels out of the token step as the merge does); `default`: the settings
  resolve() decides on this machine.

A token step is (time of N new tokens - time of 1) / (N - 1), the best of `--repeats`, so the prefill and the
once-per-call merge cancel out; the eos is an id the model never produces, so every row runs N tokens.

The floor is a timed read of the bytes a decode step must read: every weight tensor the forward uses (the
projections, the LM head, norms) reduced once (amax) per pass, best of 5 passes; its GB/s is printed. The report
gives each variant's step in ms, its ratio to the floor and to `transformers`, and the prefill.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.harness import REPO, command_line, machine, write_report

OUT = REPO / "bench" / "results" / "decode_step.json"
VARIANTS = {  # name: decode settings (config keys) on top of the preset's; one lever more on each line
    "transformers": ["decode.loop=transformers"],
    "loop": ["decode.loop=lowvram", "decode.sampler=multinomial", "decode.merge_lora=false", "decode.fused=false"],
    "loop+inverse_cdf": ["decode.loop=lowvram", "decode.sampler=inverse_cdf", "decode.merge_lora=false",
                         "decode.fused=false"],
    "loop+inverse_cdf+merged": ["decode.loop=lowvram", "decode.sampler=inverse_cdf", "decode.merge_lora=true",
                                "decode.fused=false"],
    "loop+inverse_cdf+merged+fused": ["decode.loop=lowvram", "decode.sampler=inverse_cdf", "decode.merge_lora=true",
                                      "decode.fused=true"],
    "loop+inverse_cdf+fused": ["decode.loop=lowvram", "decode.sampler=inverse_cdf", "decode.merge_lora=false",
                               "decode.fused=true"],  # the fused layers, the adapter unmerged on the base in place
    "loop+inverse_cdf+merged+fused+int8": ["decode.loop=lowvram", "decode.sampler=inverse_cdf",
                                           "decode.merge_lora=true", "decode.fused=true", "decode.weights=int8"],
    "default": [],  # what resolve decides on this machine
}


def synchronize() -> None:
    """Wait for the device's queued work (CUDA runs kernels asynchronously: a timer read without this would stop
    before them); nothing on a CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_read_floor(model, passes: int = 5) -> tuple[float, int]:
    """Seconds of the best pass reading every parameter tensor once, and the bytes read. The read is a max over the
    tensor's bytes seen as int16 (measured the fastest full read here: 22 GB/s, vs 16-17 for a bf16 sum and 4 for a
    bf16 amax); the matmuls must read at least as much per token step."""
    import torch

    tensors = [p.detach() for p in model.parameters() if p.dtype.is_floating_point]
    seen, unique = set(), []
    for t in tensors:  # tied embeddings / LM head: one tensor, read once per step
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            unique.append(t)
    nbytes = sum(t.numel() * t.element_size() for t in unique)
    best = float("inf")
    with torch.no_grad():
        for _ in range(passes + 1):
            synchronize()
            started = time.perf_counter()
            for t in unique:
                t.view(torch.int16).max()
            synchronize()
            best = min(best, time.perf_counter() - started)
    return best, nbytes


def profile_ops(model, timed, tokens: int, top: int = 12) -> dict:
    """The long call under torch.profiler: the ops that took the most time, per token step (the prefill included,
    spread over the steps), and how many ops a token step runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed(tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    return {"wall_ms_per_token_under_profiler": round(wall * 1e3 / tokens, 2),
            "ops_per_token": round(sum(e.count for e in events) / tokens),
            "top": [{"op": e.key, "ms_per_token": round(e.self_cpu_time_total / 1e3 / tokens, 2),
                     "calls_per_token": round(e.count / tokens, 1),
                     "share": round(e.self_cpu_time_total / total_us, 3)} for e in events[:top]]}


def reinstall(model, resolved) -> None:
    from lowvram_grpo.model import decoding

    if "generate" in model.__dict__:
        del model.__dict__["generate"]
    model._lowvram_decode = None
    decoding.install(model, resolved.decode)


def rollout_batch(config, hardware):
    """(resolved settings, loaded model handle, the encoded rollout batch) of `config` on the hf backend: its first
    train questions as chat prompts, each repeated num_generations times up to one micro-step's batch, left-padded
    [batch, prompt] (what a GRPO step's generate call gets). Shared by bench/merge_reuse.py."""
    from lowvram_grpo.model.backends import load_model, prepare_backend
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.task.data import load_questions, to_prompt_rows

    resolved = resolve(config, hardware, "hf")
    prepare_backend(resolved.backend)
    handle = load_model(resolved, log=lambda *_: None)
    tokenizer = handle.tokenizer
    train, _ = load_questions(config.data)
    group, batch = config.train.num_generations, config.train.batch_size
    rows = to_prompt_rows(train[: max(1, batch // group)], config.data.system_prompt)
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    texts = [t for t in texts for _ in range(group)][:batch]
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(handle.model.device)
    return resolved, handle, encoded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2_cpu")
    parser.add_argument("--tokens", type=int, default=33, help="new tokens of the long call (default 33)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE settings for every variant")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the last variant's long call (torch.profiler): its top ops per token step")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    import torch

    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve

    hardware = detect()
    base = load_config(args.preset, args.set)
    resolved, handle, encoded = rollout_batch(base, hardware)
    model, tokenizer = handle.model, handle.tokenizer
    never = model.get_base_model().config.vocab_size + 7  # an eos id no token has: every row runs all tokens
    floor_s, floor_bytes = weight_read_floor(model)
    print(f"[bench] floor: {floor_bytes / 1e6:.0f} MB of weights read in {floor_s * 1e3:.1f} ms "
          f"({floor_bytes / floor_s / 1e9:.1f} GB/s); batch {tuple(encoded['input_ids'].shape)}", file=sys.stderr)

    def timed(n: int) -> float:
        torch.manual_seed(0)
        synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(**encoded, max_new_tokens=n, do_sample=True, temperature=base.train.temperature,
                           top_p=base.train.top_p, top_k=0, eos_token_id=never, pad_token_id=tokenizer.pad_token_id)
        synchronize()
        return time.perf_counter() - started

    results = {}
    for name in args.variants.split(","):
        variant = resolve(load_config(args.preset, args.set + VARIANTS[name]), hardware, "hf")
        reinstall(model, variant)
        timed(2)  # warm-up
        one = min(timed(1) for _ in range(args.repeats))
        full = min(timed(args.tokens) for _ in range(args.repeats))
        step = (full - one) / (args.tokens - 1)
        results[name] = {"decode": variant.decode.describe(), "step_ms": round(step * 1e3, 2),
                         "prefill_and_first_token_ms": round(one * 1e3, 1),
                         "x_floor": round(step / floor_s, 2)}
        print(f"[bench] {name}: {step * 1e3:.1f} ms a token step ({step / floor_s:.2f}x the floor)", file=sys.stderr)
    profile = profile_ops(model, timed, args.tokens) if args.profile else None
    if "transformers" in results:
        for r in results.values():
            r["speedup_vs_transformers"] = round(results["transformers"]["step_ms"] / r["step_ms"], 2)
    report = {
        "command": command_line("bench.decode_step"),
        "machine": {**machine(), "hardware": hardware.describe(), "dtype": resolved.dtype},
        "settings": {"preset": args.preset, "batch": list(encoded["input_ids"].shape), "tokens": args.tokens,
                     "repeats": args.repeats, "extra": args.set},
        "floor": {"bytes": floor_bytes, "read_ms": round(floor_s * 1e3, 2),
                  "gb_per_s": round(floor_bytes / floor_s / 1e9, 1),
                  "how": "best of 5 passes of a max over every parameter tensor's bytes as int16 (tied ones once)"},
        "variants": results,
        **({"profile_of_last_variant": profile} if profile else {}),
    }
    print(json.dumps(results, indent=1))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
