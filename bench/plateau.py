"""GRPO past priming's plateau (issue 22, section 4): does GRPO add held-out accuracy to a converged priming?

    python -m bench.plateau prime --seed 3407 --steps 335 --measure-at 100,150,200 --save-at 285-334
                          # one priming: the curve (measured at 100, 150, 200, 335) and checkpoints for equal time
    python -m bench.plateau grpo --seed 3407 --prime-steps 200 --grpo-steps 24 --variants default,lr2e-5
    python -m bench.plateau measure --seed 3407 --steps 313        # prime-only at equal time (`table` says N)
    flock /tmp/lowvram-cpu.lock python -m bench.plateau times --variants default,correct_only   # s/step, alone
    python -m bench.plateau table --seeds 3407,1,2 --variants default,correct_only   # docs/results.md's table
    python -m bench.plateau list

`--set KEY=VALUE` applies to every step (priming, GRPO, timing): keep one `--root` per such setting. Everything
lives under `--root` (default runs/plateau/PRESET, ignored by git) so a long screen survives restarts:
`seed-S/prime-N/` (adapter/, result.json) and `seed-S/prime-N/grpo-VARIANT-G/` (adapter/, metrics.jsonl,
result.json); a step whose result.json exists is not run again. The seed sets `lora.random_state` and
`train.seed` (as the default job's seeds do); the data, the held-out questions and the protocol are the
`--preset`'s (smollm2_cpu: 128 built-in questions, greedy, batch 32, evaluation.evaluate).

- `prime`: a fresh LoRA, `--steps` supervised priming steps (priming.prime, the preset's batch and lr),
  saved and measured; `--save-at` / `--measure-at` also save (and measure) the adapter on the way. Priming's
  data order has no randomness and its lr is constant, so the adapter at step n of a longer priming is prime-n's
  (tests/test_plateau.py checks it bit for bit): the equal-time prime-only baseline is a checkpoint of the same
  priming, or a `prime` run with more steps (as lowvram_grpo.baseline primes from scratch).
- `measure`: measure a checkpoint that `prime --save-at` saved without measuring.
- `grpo`: in a fresh process per variant (as bench/levers.py does), the base model gets the primed LoRA
  weights, `--grpo-steps` GRPO steps run through training.build_trainer with the variant's `--set`
  overrides, and the adapter is measured on the same questions. result.json holds the numbers, the
  training signal (reward, all-right / all-wrong groups, KL) and the train seconds (not comparable under load).
- `times`: per-step wall time of priming and of each variant's GRPO step, measured in this process and
  fresh ones one after the other; run it alone under the shared CPU lock. The equal-time budget of a variant
  is then prime steps + grpo steps x (GRPO s/step / priming s/step), rounded to the nearest step.
- `table`: markdown of primed -> after (paired, McNemar) and prime-only at equal time, per seed, and each
  seed's priming curve. Equal time comes from `times` when it has the variant, else from the runs' own wall
  times (priming's seconds per step against the GRPO phase's seconds; both ran alone under the lock). Where that
  step count was not measured, the shortest measured priming above it stands in, and the row says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.levers import _measured, _setup

PRESET = "smollm2_cpu"  # --preset: the default job's model and data
CORRECT_ONLY = "rewards.weights=[0.0, 0.0, 0.0, 0.0, 1.0]"

# name -> --set overrides on top of the preset's GRPO settings (smollm2_cpu: lr 1e-4, beta 0, 2 prompts x 8, T 1.0,
# weights [0.25, 0.25, 0.25, 0, 1], scale_rewards group, cosine schedule with 10% warm-up)
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "lr1e-5": ["train.learning_rate=1e-5"],
    "lr2e-5": ["train.learning_rate=2e-5"],
    "correct_only": [CORRECT_ONLY],
    "no_std": ["train.scale_rewards=none", "train.loss_type=dr_grpo"],
    "beta0.04": ["train.beta=0.04"],
    "gen16": ["train.num_generations=16", "train.per_device_train_batch_size=32"],
    "prompts4": ["train.per_device_train_batch_size=32"],  # 4 questions x 8 per step: more groups with signal
    "prompts4_beta0.04": ["train.per_device_train_batch_size=32", "train.beta=0.04"],  # + KL to the primed adapter
    "temp1.2": ["train.temperature=1.2"],
    "correct_only_lr2e-5": [CORRECT_ONLY, "train.learning_rate=2e-5"],
    "correct_only_no_std": [CORRECT_ONLY, "train.scale_rewards=none", "train.loss_type=dr_grpo"],
}


def seed_overrides(seed: int) -> list[str]:
    return [f"lora.random_state={seed}", f"train.seed={seed}"]


def prime_dir(root: Path, seed: int, steps: int) -> Path:
    return root / f"seed-{seed}" / f"prime-{steps}"


def grpo_dir(root: Path, seed: int, prime_steps: int, variant: str, grpo_steps: int) -> Path:
    return prime_dir(root, seed, prime_steps) / f"grpo-{variant}-{grpo_steps}"


def _write(path: Path, data: dict) -> None:
    from lowvram_grpo.model.lora_io import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


# --------------------------------------------------------------------------- prime
def _steps_list(text: str) -> list[int]:
    """'100,150,200-205' -> [100, 150, 200, 201, 202, 203, 204, 205]."""
    steps = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        steps.update(range(int(low), int(high or low) + 1))
    return sorted(steps)


def _prime_result(handle, eval_rows, config, args, steps: int, seconds: float, last_loss) -> None:
    from lowvram_grpo.evaluate.evaluation import evaluate

    out = prime_dir(args.root, args.seed, steps)
    numbers, texts = evaluate(handle, eval_rows, handle.plan.eval, lora_request=handle.load_lora(out / "adapter"))
    _write(out / "result.json", {"seed": args.seed, "prime_steps": steps, "common": args.common,
                                 "prime_seconds": round(seconds, 1), "last_loss": last_loss,
                                 "numbers": _measured(numbers) | {"protocol": numbers["protocol"]},
                                 "sample": texts[:2]})
    print(f"{out}: strict {numbers['accuracy_strict']:.3f} lenient {numbers['accuracy_lenient']:.3f} "
          f"format {numbers['format_rate']:.3f} ({seconds:.0f} s priming)", flush=True)


def prime(args) -> int:
    """One priming of `--steps`; the adapter is saved at every `--save-at` step count and measured at every
    `--measure-at` one (and at the end). Priming's data order has no randomness and its optimizer runs on, so the
    adapter saved at step n is prime-n's (the equal-time baseline for any n is a checkpoint of the one long run;
    tests/test_plateau.py checks it bit for bit); the seconds saved beside it exclude saving and measuring."""
    try:
        measure_at = set(_steps_list(args.measure_at)) | {args.steps}
        save_at = set(_steps_list(args.save_at)) | measure_at
    except ValueError:
        print(f"error: --save-at/--measure-at take step counts like 100,150,290-330; got {args.save_at!r} / "
              f"{args.measure_at!r}", file=sys.stderr)
        return 2
    if any(n > args.steps or n < 1 for n in save_at):
        print(f"error: --save-at/--measure-at must lie within 1..{args.steps} (--steps)", file=sys.stderr)
        return 2
    out = prime_dir(args.root, args.seed, args.steps)
    if (out / "result.json").is_file():
        print(f"{out}: done already", flush=True)
        return 0
    from lowvram_grpo.training.priming import prime as run_priming

    config, handle, train_q, eval_rows = _setup(args.preset, [*args.common, *seed_overrides(args.seed),
                                                               f"prime.steps={args.steps}"])
    made = []  # the checkpoints this run saved; one an earlier run left is not written again

    def checkpoint(done: int, seconds: float) -> None:
        if done not in save_at:
            return
        target = prime_dir(args.root, args.seed, done)
        if (target / "result.json").is_file() or (target / "trajectory.json").is_file():
            return  # kept as made (the same adapter: an earlier priming of this seed saved it)
        made.append(done)
        handle.save_lora(target / "adapter")
        _write(target / "trajectory.json", {"seed": args.seed, "prime_steps": done, "of_run": args.steps,
                                            "prime_seconds": round(seconds, 1), "common": args.common})
        if done in measure_at:
            _prime_result(handle, eval_rows, config, args, done, seconds, None)

    losses = run_priming(handle, train_q, handle.plan.prime, log=print, on_step=checkpoint).get("losses", [])
    for n in measure_at & set(made):  # the losses are known at the end
        path = prime_dir(args.root, args.seed, n) / "result.json"
        _write(path, _read(path) | {"last_loss": losses[n - 1] if len(losses) >= n else None})
    return 0


def measure(args) -> int:
    """Measure a checkpoint that `prime --save-at` saved without measuring (the equal-time baseline, once its step
    count is known)."""
    out = prime_dir(args.root, args.seed, args.steps)
    if (out / "result.json").is_file():
        print(f"{out}: done already", flush=True)
        return 0
    if not (out / "trajectory.json").is_file():
        print(f"error: {out} holds no saved checkpoint: "
              f"run `python -m bench.plateau prime --seed {args.seed} --steps N "
              f"--save-at {args.steps}` (N >= {args.steps}) first", file=sys.stderr)
        return 2
    saved = _read(out / "trajectory.json")
    config, handle, _, eval_rows = _setup(args.preset, [*args.common, *seed_overrides(args.seed)])
    _prime_result(handle, eval_rows, config, args, args.steps, saved["prime_seconds"], None)
    return 0


# --------------------------------------------------------------------------- grpo
def _signal(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]

    def mean_of(key, part):
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return round(statistics.mean(values), 4) if values else None

    third = max(1, len(rows) // 3)
    keys = ("reward", "rewards/correctness/mean", "frac_reward_zero_std", "groups/all_right", "groups/all_wrong", "kl",
            "completions/mean_length", "completions/clipped_ratio")
    return {f"{key}|{part}": mean_of(key, sel) for key in keys
            for part, sel in (("first_third", rows[:third]), ("last_third", rows[-third:]), ("all", rows))}


def one_grpo(spec: dict) -> int:
    """In this (fresh) process: the primed weights in, GRPO, save, measure; result.json."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from lowvram_grpo.task.data import drop_long_prompts, to_prompt_rows
    from lowvram_grpo.evaluate.evaluation import evaluate
    from lowvram_grpo.training.grpo import build_trainer

    out = Path(spec["out"])
    config, handle, train_q, eval_rows = _setup(spec["preset"], spec["overrides"])
    weights = load_file(str(Path(spec["primed"]) / "adapter_model.safetensors"))
    loaded = set_peft_model_state_dict(handle.model, weights)
    assert not [k for k in loaded.unexpected_keys if "lora" in k], loaded.unexpected_keys
    train_rows, _ = drop_long_prompts(to_prompt_rows(train_q, config.data.system_prompt), handle.tokenizer,
                                      config.train.max_prompt_length)
    trainer = build_trainer(handle, train_rows, out)
    started = time.time()
    trainer.train()
    train_seconds = time.time() - started
    adapter = handle.save_lora(out / "adapter")
    numbers, texts = evaluate(handle, eval_rows, handle.plan.eval, lora_request=handle.load_lora(adapter))
    _write(out / "result.json", {**spec, "train_seconds": round(train_seconds, 1),
                                 "numbers": _measured(numbers) | {"protocol": numbers["protocol"]},
                                 "training": _signal(out / "metrics.jsonl"), "sample": texts[:2]})
    return 0


def grpo(args) -> int:
    primed = prime_dir(args.root, args.seed, args.prime_steps)
    if not (primed / "result.json").is_file():
        print(f"error: {primed} has no primed adapter: run `python -m bench.plateau prime --seed {args.seed} "
              f"--steps {args.prime_steps}` first", file=sys.stderr)
        return 2
    start = _read(primed / "result.json")["numbers"]
    failed = []
    for variant in args.variants.split(","):
        out = grpo_dir(args.root, args.seed, args.prime_steps, variant, args.grpo_steps)
        if (out / "result.json").is_file():
            print(f"{out}: done already", flush=True)
            continue
        overrides = [*args.common, *seed_overrides(args.seed), f"train.max_steps={args.grpo_steps}",
                     f"train.save_steps={args.grpo_steps + 1}", *VARIANTS[variant]]
        spec = {"preset": args.preset, "variant": variant, "sets": VARIANTS[variant], "seed": args.seed,
                "prime_steps": args.prime_steps, "grpo_steps": args.grpo_steps, "overrides": overrides,
                "primed": str(primed / "adapter"), "out": str(out)}
        proc = subprocess.run([sys.executable, "-m", "bench.plateau", "one", json.dumps(spec)])
        if proc.returncode != 0:
            print(f"{variant} seed {args.seed} failed (exit {proc.returncode})", flush=True)
            failed.append(variant)
            continue
        after = _read(out / "result.json")["numbers"]
        print(f"{variant} seed {args.seed}: strict {start['accuracy_strict']:.3f} -> {after['accuracy_strict']:.3f}, "
              f"lenient {start['accuracy_lenient']:.3f} -> {after['accuracy_lenient']:.3f}", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------- times (alone, under the lock)
def one_time(spec: dict) -> int:
    """In this (fresh) process: seconds per GRPO step of a variant, from the primed weights."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from lowvram_grpo.task.data import drop_long_prompts, to_prompt_rows
    from lowvram_grpo.training.grpo import build_trainer

    config, handle, train_q, _ = _setup(spec["preset"], spec["overrides"])
    set_peft_model_state_dict(handle.model, load_file(str(Path(spec["primed"]) / "adapter_model.safetensors")))
    train_rows, _ = drop_long_prompts(to_prompt_rows(train_q, config.data.system_prompt), handle.tokenizer,
                                      config.train.max_prompt_length)
    ends = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    trainer = build_trainer(handle, train_rows, Path(spec["out"]))
    trainer.add_callback(StepTimes())
    started = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([started] + ends, ends)]
    print(json.dumps({"grpo_step_seconds": steps}))
    return 0


def times(args) -> int:
    import tempfile

    from lowvram_grpo.training.priming import prime as run_priming

    primed = prime_dir(args.root, args.seed, args.prime_steps) / "adapter"
    config, handle, train_q, _ = _setup(args.preset, [*args.common, *seed_overrides(args.seed),
                                                      f"prime.steps={args.time_prime_steps}"])
    started = time.perf_counter()
    priming = run_priming(handle, train_q, handle.plan.prime, log=lambda *a: None)
    total = time.perf_counter() - started  # over all steps, the first one's warm-up included
    result = {"command": "python -m bench.plateau " + " ".join(sys.argv[1:]), "common": args.common,
              "threads": __import__("torch").get_num_threads(), "prime_steps_timed": priming["steps"],
              "prime_seconds": round(total, 2), "prime_seconds_per_step": round(total / priming["steps"], 3),
              "grpo": {}}
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"preset": args.preset, "overrides": [*args.common, *seed_overrides(args.seed),
                                                         f"train.max_steps={args.time_grpo_steps}",
                                                         f"train.save_steps={args.time_grpo_steps + 1}",
                                                         "eval.enabled=false", *VARIANTS[variant]],
                    "primed": str(primed), "out": tmp}
            proc = subprocess.run([sys.executable, "-m", "bench.plateau", "one-time", json.dumps(spec)],
                                  capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{variant} failed:\n{proc.stderr[-3000:]}", flush=True)
            result["failed"] = [*result.get("failed", []), variant]
            continue
        steps = json.loads(proc.stdout.strip().splitlines()[-1])["grpo_step_seconds"]
        median = statistics.median(steps[1:])  # the first step pays one-time costs (kernels, caches)
        result["grpo"][variant] = {"step_seconds": [round(s, 2) for s in steps],
                                   "median_seconds_per_step": round(median, 3),
                                   "ratio_to_priming_step": round(median / result["prime_seconds_per_step"], 3)}
        print(f"{variant}: {median:.2f} s per GRPO step, "
              f"{result['grpo'][variant]['ratio_to_priming_step']:.2f} priming steps",
              flush=True)
    args.times_out.parent.mkdir(parents=True, exist_ok=True)
    _write(args.times_out, result)
    return 1 if result.get("failed") else 0


# --------------------------------------------------------------------------- table
def _acc(numbers: dict, key: str) -> str:
    lo, hi = numbers[f"{key}_ci"]
    return f"{numbers[key]:.3f} [{lo:.2f}, {hi:.2f}]"


def _paired(start: dict, end: dict, key: str) -> str:
    from lowvram_grpo.evaluate.evaluation import paired_change

    gained, lost, p = paired_change(start, end, key)
    return f"{end[key] - start[key]:+.3f}, +{gained}/-{lost} (p {'< 0.001' if p < 0.001 else f'{p:.3f}'})"


def equal_time_steps(times_data, variant: str, primed: dict, result: dict) -> tuple[int, str]:
    """Priming steps that take as long as priming + this GRPO run, and where the ratio came from: `times` (step
    medians measured alone) when it has the variant, else the two runs' own wall times (priming's seconds per step
    against the GRPO phase's seconds: comparable when both ran alone, as docs/results.md's runs did)."""
    prime_steps, grpo_steps = primed["prime_steps"], result["grpo_steps"]
    if times_data and variant in times_data["grpo"]:
        return round(prime_steps + grpo_steps * times_data["grpo"][variant]["ratio_to_priming_step"]), "times"
    return round(prime_steps + result["train_seconds"] / (primed["prime_seconds"] / prime_steps)), "runs' own seconds"


def measured_primings(root: Path, seed: int) -> list[int]:
    """The step counts of `seed`'s primings that have a result.json, ascending."""
    names = (d.name.removeprefix("prime-") for d in (root / f"seed-{seed}").glob("prime-*")
             if (d / "result.json").is_file())
    return sorted(int(name) for name in names if name.isdigit())


def nearest_measured_at_or_above(root: Path, seed: int, steps: int) -> tuple[int, dict | None]:
    """The measured priming of `steps` steps, else the shortest measured one longer than that (prime-only then gets
    more time than GRPO had, never less); (steps, None) when there is none."""
    longer = [n for n in measured_primings(root, seed) if n >= steps]
    return (longer[0], _read(prime_dir(root, seed, longer[0]) / "result.json")) if longer else (steps, None)


def table(args) -> int:
    times_data = _read(args.times_out)
    lines = ["| seed | variant | primed (prime steps) | after GRPO | "
             "GRPO's change, paired (newly right/wrong, McNemar p) "
             "| prime-only, equal time (steps) | after GRPO - prime-only, paired |", "|---|---|---|---|---|---|---|"]
    for seed in [int(s) for s in args.seeds.split(",")]:
        primed = _read(prime_dir(args.root, seed, args.prime_steps) / "result.json")
        if primed is None:
            continue
        for variant in args.variants.split(","):
            result = _read(grpo_dir(args.root, seed, args.prime_steps, variant, args.grpo_steps) / "result.json")
            if result is None:
                continue
            for key, label in (("accuracy_strict", "strict"), ("accuracy_lenient", "lenient")):
                versus = ""
                n, source = equal_time_steps(times_data, variant, primed, result)
                steps, baseline = nearest_measured_at_or_above(args.root, seed, n)
                if baseline:
                    more = "" if steps == n else f": equal time is {n}, the nearest measured above it"
                    equal = f"{_acc(baseline['numbers'], key)} ({steps}{more})"
                    versus = _paired(baseline["numbers"], result["numbers"], key)
                else:
                    equal = f"not run ({n} steps, from {source})"
                lines.append(f"| {seed} | {variant} ({label}) | {_acc(primed['numbers'], key)} ({args.prime_steps}) | "
                             f"**{_acc(result['numbers'], key)}** | "
                             f"{_paired(primed['numbers'], result['numbers'], key)} | "
                             f"{equal} | {versus} |")
    lines += ["", "| seed | priming steps | strict | lenient | format | priming s |", "|---|---|---|---|---|---|"]
    for seed in [int(s) for s in args.seeds.split(",")]:  # the priming curve: where its plateau is
        measured = [_read(prime_dir(args.root, seed, n) / "result.json") for n in measured_primings(args.root, seed)]
        lines += [f"| {seed} | {r['prime_steps']} | {_acc(r['numbers'], 'accuracy_strict')} | "
                  f"{_acc(r['numbers'], 'accuracy_lenient')} | {r['numbers']['format_rate']:.3f} | "
                  f"{r['prime_seconds']} |"
                  for r in measured]
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plateau", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["prime", "measure", "grpo", "times", "table", "one", "one-time", "list"])
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)  # internal: one grpo run's JSON spec
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--root", type=Path, default=None, help="default: runs/plateau/PRESET")
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--seeds", default="3407,1,2")
    parser.add_argument("--steps", type=int, default=200, help="prime: priming steps")
    parser.add_argument("--save-at", default="", metavar="N,N",
                        help="prime: also save the adapter at these step counts")
    parser.add_argument("--measure-at", default="", metavar="N,N",
                        help="prime: also save and measure at these step counts")
    parser.add_argument("--prime-steps", type=int, default=200,
                        help="grpo/times/table: the primed adapter to start from")
    parser.add_argument("--grpo-steps", type=int, default=48)
    parser.add_argument("--variants", default="default")
    parser.add_argument("--set", dest="common", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every step (keep the same per --root), e.g. model.dtype=float32")
    parser.add_argument("--time-prime-steps", type=int, default=20)
    parser.add_argument("--time-grpo-steps", type=int, default=8)
    parser.add_argument("--times-out", type=Path, default=Path("bench/results/plateau_times.json"))
    args = parser.parse_args(argv)
    args.root = args.root or Path("runs/plateau") / args.preset
    if args.action == "list":
        for name, sets in VARIANTS.items():
            print(f"{name:<22}{' '.join(sets) or '(the preset)'}")
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}: pick from {', '.join(VARIANTS)} (python -m bench.plateau list)",
              file=sys.stderr)
        return 2
    if args.action == "one":
        return one_grpo(json.loads(args.spec))
    if args.action == "one-time":
        return one_time(json.loads(args.spec))
    return {"prime": prime, "measure": measure, "grpo": grpo, "times": times, "table": table}[args.action](args)


if __name__ == "__main__":
    raise SystemExit(main())
