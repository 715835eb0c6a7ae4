"""Held-out evaluation speed against eval.batch_size, on SmolLM2 (CPU): the base model and a primed adapter.

    python -m bench.eval_batch --eval-size 64 --batch-sizes 8,16,32,64 --prime-steps 10

Same questions, sampling and max_completion_length as the `smollm2_cpu` preset; one warm-up batch first.
Prints and writes (`--out`) seconds per question and the accuracies per batch size.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eval_batch")
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,16,32,64")
    parser.add_argument("--prime-steps", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("bench/results/eval_batch.json"))
    args = parser.parse_args(argv)

    from lowvram_grpo.model.backends import load_model, prepare_backend

    prepare_backend("hf")
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions, to_prompt_rows
    from lowvram_grpo.evaluate.evaluation import generate_answers, score
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.training.priming import prime
    from lowvram_grpo.settings.resolve import resolve

    config = load_config("smollm2_cpu", [f"data.eval_size={args.eval_size}", f"prime.steps={args.prime_steps}",
                                         *args.overrides])
    handle = load_model(resolve(config, detect(), "hf"))
    train, held_out = load_questions(config.data)
    rows = to_prompt_rows(held_out, config.data.system_prompt)
    generate_answers(handle, rows[:4], handle.plan.eval, None)  # warm-up
    results = []

    def measure(model: str, lora_request):
        for size in [int(s) for s in args.batch_sizes.split(",")]:
            plan = dataclasses.replace(handle.plan.eval, batch_size=size)
            started = time.time()
            generated = generate_answers(handle, rows, plan, lora_request)
            seconds = time.time() - started
            numbers = score(rows, generated, plan)
            row = {"model": model, "batch_size": size, "seconds": round(seconds, 1),
                   "seconds_per_question": round(seconds / len(rows), 3),
                   "mean_completion_tokens": round(numbers["mean_completion_tokens"], 1),
                   "accuracy_strict": numbers["accuracy_strict"], "accuracy_lenient": numbers["accuracy_lenient"],
                   "format_rate": numbers["format_rate"]}
            results.append(row)
            print(json.dumps(row), flush=True)

    measure("base", None)
    prime(handle, train, handle.plan.prime, log=lambda *a: None)
    primed = handle.save_lora(Path(tempfile.mkdtemp(prefix="eval-batch-")) / "primed")
    measure(f"primed {args.prime_steps} steps", handle.load_lora(primed))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"eval_size": args.eval_size, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
