"""Screen GRPO levers on SmolLM2 (CPU): which settings make GRPO raise held-out *correctness*?

    python -m bench.levers --prime-steps 20 --eval-size 128 --steps 30 --variants base,correct_heavy
    python -m bench.levers --list

The `smollm2_cpu` preset's model is primed once (`--prime-steps`, lora seed 3407), saved and measured
(cached in `--cache` by prime steps and eval size); then each variant runs in a fresh Python process
(a second GRPOTrainer on the same in-memory model was seen to sample ~15x slower): the base model is
loaded, the primed LoRA weights are put in, `--steps` GRPO steps run through the package's own
trainer (`training.build_trainer`) with the variant's `--set` overrides, and the adapter is measured on
the same held-out questions with `evaluation.evaluate` (strict and lenient accuracy, 95% Wilson
intervals, per-question verdicts). Shortened on purpose: it ranks levers; the full default job
(`python -m lowvram_grpo.run`, 3 seeds) is what docs/results.md reports.

Run it under the shared CPU lock (`flock /tmp/lowvram-cpu.lock python -m bench.levers ...`). Results
are appended to `--out` (JSON), one record per variant and seed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = "rewards.weights=[0.25, 0.25, 0.25, 0.0, 1.0]"  # correctness 2.0 of a 2.375 maximum (format 0.375)

# name -> --set overrides on top of the smollm2_cpu preset (and the common ones from the command line)
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "correct_heavy": [HEAVY],
    "correct_only": ["rewards.names=[correctness, soft_format]", "rewards.weights=[1.0, 0.25]"],
    "two_prompts": ["train.per_device_train_batch_size=16"],
    "two_prompts_heavy": ["train.per_device_train_batch_size=16", HEAVY],
    "dr_grpo": ["train.loss_type=dr_grpo", "train.scale_rewards=none"],
    "heavy_dr_grpo": [HEAVY, "train.loss_type=dr_grpo", "train.scale_rewards=none"],
    "heavy_dapo": [HEAVY, "train.loss_type=dapo", "train.mask_truncated_completions=true"],
    "heavy_lr2e-4": [HEAVY, "train.learning_rate=2e-4"],
    "heavy_lr5e-5": [HEAVY, "train.learning_rate=5e-5"],
    "heavy_batch_std": [HEAVY, "train.scale_rewards=batch"],
}


def _measured(numbers: dict) -> dict:
    keep = ("reward_mean", "accuracy_strict", "accuracy_strict_ci", "accuracy_lenient", "accuracy_lenient_ci",
            "format_rate", "mean_completion_tokens", "n", "strict_correct", "lenient_correct")
    return {k: numbers[k] for k in keep}


def _training_signal(metrics_path: Path) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}

    def mean_of(key, part):
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return round(statistics.mean(values), 3) if values else None

    third = max(1, len(rows) // 3)
    return {
        "correctness_first_third": mean_of("rewards/correctness/mean", rows[:third]),
        "correctness_last_third": mean_of("rewards/correctness/mean", rows[-third:]),
        "reward_first_third": mean_of("reward", rows[:third]),
        "reward_last_third": mean_of("reward", rows[-third:]),
        "frac_reward_zero_std": mean_of("frac_reward_zero_std", rows),
        "clipped_ratio": mean_of("completions/clipped_ratio", rows),
        "mean_length_last_third": mean_of("completions/mean_length", rows[-third:]),
    }


def _setup(preset: str, overrides: list[str]):
    from lowvram_grpo.model.backends import load_model, prepare_backend

    prepare_backend("hf")
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.task.data import load_questions, to_prompt_rows

    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve

    config = load_config(preset, overrides)
    handle = load_model(resolve(config, detect(), "hf"))
    train_q, eval_q = load_questions(config.data)
    return config, handle, train_q, to_prompt_rows(eval_q, config.data.system_prompt)


def prime_once(args, common: list[str]) -> tuple[Path, dict, float]:
    """The primed adapter and its numbers, from the cache or made now."""
    key = hashlib.sha1(json.dumps(args.common).encode()).hexdigest()[:8]
    cache = args.cache / f"{args.preset}-prime{args.prime_steps}-eval{args.eval_size}-{key}"
    if (cache / "primed.json").is_file():
        saved = json.loads((cache / "primed.json").read_text())
        return cache / "primed", saved["numbers"], saved["seconds"]
    from lowvram_grpo.evaluate.evaluation import evaluate
    from lowvram_grpo.training.priming import prime

    config, handle, train_q, eval_rows = _setup(args.preset, common)
    started = time.time()
    prime(handle, train_q, handle.plan.prime, log=lambda *a: None)
    seconds = time.time() - started
    adapter = handle.save_lora(cache / "primed")
    numbers, _ = evaluate(handle, eval_rows, handle.plan.eval, lora_request=handle.load_lora(adapter))
    (cache / "primed.json").write_text(json.dumps({"numbers": _measured(numbers), "seconds": seconds}) + "\n")
    return adapter, _measured(numbers), seconds


def one_variant(args) -> int:
    """In a fresh process: primed weights in, GRPO with the variant's overrides, measure; JSON on stdout's last line."""
    spec = json.loads(args.one)
    config, handle, train_q, eval_rows = _setup(args.preset, spec["overrides"])
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from lowvram_grpo.task.data import drop_long_prompts, to_prompt_rows
    from lowvram_grpo.evaluate.evaluation import evaluate
    from lowvram_grpo.training.grpo import build_trainer

    weights = load_file(str(Path(spec["primed"]) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(handle.model, weights)
    assert not [k for k in result.unexpected_keys if "lora" in k], result.unexpected_keys
    train_rows, _ = drop_long_prompts(to_prompt_rows(train_q, config.data.system_prompt), handle.tokenizer,
                                      config.train.max_prompt_length)
    out = Path(spec["out"])
    trainer = build_trainer(handle, train_rows, out)
    started = time.time()
    trainer.train()
    train_seconds = time.time() - started
    adapter = handle.save_lora(out / "adapter")
    started = time.time()
    after, texts = evaluate(handle, eval_rows, handle.plan.eval, lora_request=handle.load_lora(adapter))
    print(json.dumps({"train_seconds": round(train_seconds, 1), "eval_seconds": round(time.time() - started, 1),
                      "after": _measured(after), "training": _training_signal(out / "metrics.jsonl"),
                      "sample": texts[:3]}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.levers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2_cpu")
    parser.add_argument("--prime-steps", type=int, default=20)
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per variant")
    parser.add_argument("--variants", default="base", help="comma-separated names (see --list)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME:KEY=VALUE;KEY=VALUE",
                        help="an ad-hoc variant: its name, then --set overrides separated by ';'")
    parser.add_argument("--set", dest="common", action="append", default=[],
                        help="override for priming and every variant")
    parser.add_argument("--seeds", default="3407", help="train.seed values per variant (comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/levers.json"))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/lowvram-levers"))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one variant in this process
    args = parser.parse_args(argv)
    if args.one:
        return one_variant(args)
    if args.list:
        for name, sets in VARIANTS.items():
            print(f"{name:<20}{' '.join(sets) or '(the preset)'}")
        return 0
    variants = {n: VARIANTS[n] for n in args.variants.split(",") if n}
    for spec in args.extra:
        name, _, sets = spec.partition(":")
        variants[name] = [s for s in sets.split(";") if s]

    common = [f"data.eval_size={args.eval_size}", f"prime.steps={args.prime_steps}", *args.common]
    primed_dir, primed, prime_seconds = prime_once(args, common)
    print(f"primed ({args.prime_steps} steps, {prime_seconds:.0f} s): strict {primed['accuracy_strict']:.3f} "
          f"lenient {primed['accuracy_lenient']:.3f} format {primed['format_rate']:.3f}", flush=True)
    results = json.loads(args.out.read_text()) if args.out.is_file() else []
    for name, sets in variants.items():
        for seed in [int(s) for s in args.seeds.split(",")]:
            overrides = common + [f"train.max_steps={args.steps}", f"train.save_steps={args.steps + 1}",
                                  f"train.seed={seed}", *sets]
            out = args.cache / "runs" / f"{name}-{seed}-{int(time.time())}"
            spec = json.dumps({"overrides": overrides, "primed": str(primed_dir), "out": str(out)})
            proc = subprocess.run([sys.executable, "-m", "bench.levers", "--preset", args.preset, "--one", spec],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}", flush=True)
                continue
            measured = json.loads(proc.stdout.strip().splitlines()[-1])
            after = measured["after"]
            record = {"variant": name, "sets": sets, "seed": seed, "prime_steps": args.prime_steps,
                      "grpo_steps": args.steps, "common": common,
                      "s_per_step": round(measured["train_seconds"] / args.steps, 2),
                      "prime_seconds": round(prime_seconds, 1), "primed": primed, **measured}
            results.append(record)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"{name} seed {seed}: strict {primed['accuracy_strict']:.3f} -> {after['accuracy_strict']:.3f}, "
                  f"lenient {primed['accuracy_lenient']:.3f} -> {after['accuracy_lenient']:.3f}, format "
                  f"{after['format_rate']:.3f}, {record['s_per_step']} s/step, training {measured['training']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
