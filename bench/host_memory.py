"""Benchmark: host memory (RSS) of the default CPU job, today's behaviour against the host_memory fixes.

    flock /tmp/lowvram-cpu.lock python -m bench.host_memory --keep runs/host-memory  # the whole default job per variant
    flock /tmp/lowvram-cpu.lock python -m bench.host_memory --prime-steps 10 --steps 20 --eval-size 16 \\
        --variants off,head,trim,head+trim --out bench/results/host_memory_quick.json    # quick breakdown

Each variant is one fresh `python -m lowvram_grpo.run` process (the default preset and its seed), one at
a time, differing only in their environment (`LOWVRAM_GRPO_HOST_MEMORY`, lowvram_grpo/core/host_memory.py):

- `off`:       today's behaviour (neither fix)
- `head`:      the LM head's input made contiguous (no 432 MB copy per generation prefill)
- `trim`:      glibc malloc_trim(0) after each priming step, GRPO step and held-out batch
- `head+trim`: both (the package's default)
- `head+trim+mimalloc`: both, on mimalloc (`memory.host_allocator`, lowvram_grpo/core/allocator.py): the
               package's default on a CPU run until issue 51; `release()` is then mimalloc's `mi_collect(true)`
- `head+trim+kernel_cache+mimalloc`: that, with oneDNN's and ideep's per-shape kernel caches capped at 8 entries
               (host_memory.limit_kernel_caches): the package's default on a CPU run now
- `head+mimalloc`: the head fix on mimalloc, no collection at the boundaries
- `head+mmap1m`, `head+mmap4m`: glibc alternatives to trimming (`MALLOC_MMAP_THRESHOLD_` fixed at 1 or 4
               MiB: larger blocks are mmapped and unmapped when freed, never spread the heap)
- `head+trim+mmap4m`: trimming between steps and the 4 MiB mmap threshold within them
- `head+trim+mimalloc+unmerged`: the default with decode.merge_lora=false (the fused layers read the base weights
               in place and add the adapter unmerged: no merged copy of the projections while sampling)

Every variant sets `memory.host_allocator` (system or mimalloc). The child runs the CLI's `main` in its
own process, where the CLI would restart itself on mimalloc: the bench preloads the installed
libmimalloc.so itself (the same `LD_PRELOAD`) for the mimalloc variants.

Measured inside the run's process (this module wraps `host_memory.release`, which every variant calls at
the same boundaries; with trim off it returns without trimming): RSS every 0.1 s (/proc/self/statm)
with glibc's mallinfo2 beside it (heap in use, free inside the heap, mmapped; reported at the peak),
RSS at each boundary (after the release), each step's wall and CPU seconds, and how busy the machine
was with other processes during the step (/proc/stat minus this process), so a step slowed by a
neighbour shows. Per variant: peak RSS (`ru_maxrss`, the whole process), RSS slope per GRPO step over
the last 40 GRPO steps (least squares on the boundary RSS), median GRPO and priming step time (all
steps, and steps where other processes used < 10 % of the CPUs), their ratio to the first variant,
and the held-out results (the fixes must not change them: same seed, same samples).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from bench.harness import write_report

RESULTS = Path(__file__).resolve().parent / "results"
class Variant(NamedTuple):
    features: str                    # LOWVRAM_GRPO_HOST_MEMORY: what host_memory.py keeps on
    allocator: str = "system"        # memory.host_allocator of the run
    env: tuple = ()                  # more (name, value) environment of the run
    sets: tuple = ()                 # more --set overrides of the run


VARIANTS = {
    "off": Variant("off"),
    "head": Variant("head"),
    "trim": Variant("trim"),
    "head+trim": Variant("head,trim"),
    # the package's default on a CPU run: both, on mimalloc (allocator.py)
    "head+trim+mimalloc": Variant("head,trim", "mimalloc"),
    "head+mimalloc": Variant("head", "mimalloc"),
    # issue 51: the default now, the per-shape kernel caches capped (host_memory.limit_kernel_caches)
    "head+trim+kernel_cache+mimalloc": Variant("head,trim,kernel_cache", "mimalloc"),
    # tried as alternatives to malloc_trim on glibc (both with the head fix):
    "head+mmap1m": Variant("head", env=(("MALLOC_MMAP_THRESHOLD_", "1048576"),)),
    "head+mmap4m": Variant("head", env=(("MALLOC_MMAP_THRESHOLD_", "4194304"),)),
    "head+trim+mmap4m": Variant("head,trim", env=(("MALLOC_MMAP_THRESHOLD_", "4194304"),)),
    # issue 51: the default, with the fused layers sampling from the base weights in place and the adapter unmerged
    "head+trim+mimalloc+unmerged": Variant("head,trim", "mimalloc", sets=("decode.merge_lora=false",)),
}
CLEAN = 0.10  # a step counts as clean when other processes used less than this share of the CPUs
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE / 2**20


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all CPUs, /proc/stat), since boot."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / TICKS


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def slope(values: list[float]) -> float:
    """Least-squares slope per index."""
    n = len(values)
    if n < 2:
        return float("nan")
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


# --------------------------------------------------------------------------- child: one run, instrumented


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_mb():
    """glibc's view (mallinfo2, all arenas): (in use, free inside the heap, mmapped blocks) in MB; None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def read():
        info = libc.mallinfo2()
        return info.uordblks / 2**20, info.fordblks / 2**20, info.hblkhd / 2**20

    return read


def child(result_path: Path, run_args: list[str]) -> int:
    started = time.time()
    samples: list[tuple] = []  # (t, rss, heap in use, heap free, mmapped) in MB
    heap = None if os.environ.get("LD_PRELOAD") else heap_mb()  # glibc's numbers mean nothing under another allocator

    def sample():
        while True:
            samples.append((time.time() - started, rss_mb(), *(heap() if heap else ())))
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    marks: list[dict] = []
    from lowvram_grpo.core import host_memory

    original = host_memory.release
    phases = {"prime": "prime", "generate_answers": "eval", "on_step_end": "grpo"}

    def release():  # every boundary of every variant passes here: record it
        caller = sys._getframe(1).f_code.co_name
        trimmed = original()
        marks.append({"phase": phases.get(caller, caller), "t": time.time() - started, "rss_mb": rss_mb(),
                      "python_blocks": sys.getallocatedblocks(),
                      "cpu_s": own_cpu_s(), "busy_s": machine_busy_s(), "trimmed": trimmed})
        return trimmed

    host_memory.release = release
    from lowvram_grpo.run.cli import main

    try:
        code = main(run_args)
    finally:
        result_path.write_text(json.dumps({
            "rc": None, "samples": samples, "marks": marks,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "wall_s": time.time() - started,
        }))
    data = json.loads(result_path.read_text())
    data["rc"] = code
    result_path.write_text(json.dumps(data))
    return code or 0


# --------------------------------------------------------------------------- parent: variants, one at a time


def steps_of(marks: list[dict], phase: str) -> list[dict]:
    """Per step of `phase`: wall, own CPU, other processes' CPU share, RSS at its end (after the release)."""
    out = []
    for prev, cur in zip(marks, marks[1:]):
        if cur["phase"] != phase or prev["phase"] != phase:  # a phase's first step also holds its setup
            continue
        wall = cur["t"] - prev["t"]
        own = cur["cpu_s"] - prev["cpu_s"]
        other = max(0.0, (cur["busy_s"] - prev["busy_s"]) - own) / (NCPU * wall) if wall > 0 else 0.0
        out.append({"wall_s": wall, "cpu_s": own, "other_cpu_share": other, "rss_mb": cur["rss_mb"]})
    return out


def summarize(raw: dict, window: int) -> dict:
    marks = raw["marks"]
    grpo, prime = steps_of(marks, "grpo"), steps_of(marks, "prime")
    grpo_rss = [s["rss_mb"] for s in grpo]
    last = grpo_rss[-window:]

    def med(steps, key, clean=False):
        values = [s[key] for s in steps if not clean or s["other_cpu_share"] < CLEAN]
        return round(statistics.median(values), 3) if values else None

    peaks = {}
    for prev, cur in zip([{"t": 0.0, "phase": "load"}] + marks, marks + [{"t": 1e18, "phase": "end"}]):
        inside = [x[1] for x in raw["samples"] if prev["t"] <= x[0] < cur["t"]]
        if inside:
            peaks[cur["phase"]] = max(peaks.get(cur["phase"], 0.0), max(inside))
    at_peak = max(raw["samples"], key=lambda x: x[1]) if raw["samples"] else ()
    heap_at_peak = ({"heap_in_use_mb": round(at_peak[2]), "heap_free_mb": round(at_peak[3]),
                     "mmapped_mb": round(at_peak[4])}
                    if len(at_peak) == 5 else None)
    return {
        "peak_rss_mb": round(raw["ru_maxrss_mb"]),
        "glibc_heap_at_sampled_peak": heap_at_peak,
        "peak_rss_sampled_mb_by_phase": {k: round(v) for k, v in peaks.items()},
        "rss_slope_mb_per_grpo_step_last": {"steps": len(last), "mb_per_step": round(slope(last), 2)},
        "rss_slope_mb_per_grpo_step_all": round(slope(grpo_rss), 2),
        "rss_after_priming_mb": round(next((m["rss_mb"] for m in reversed(marks) if m["phase"] == "prime"), 0)),
        "rss_first_last_grpo_step_mb": [round(grpo_rss[0]), round(grpo_rss[-1])] if grpo_rss else None,
        "grpo_step_s_median": med(grpo, "wall_s"),
        "grpo_step_s_median_clean": med(grpo, "wall_s", clean=True),
        "grpo_step_cpu_s_median": med(grpo, "cpu_s"),
        "grpo_steps": len(grpo),
        "grpo_steps_clean": sum(1 for s in grpo if s["other_cpu_share"] < CLEAN),
        "prime_step_s_median": med(prime, "wall_s"),
        "prime_step_s_median_clean": med(prime, "wall_s", clean=True),
        "other_cpu_share_median": med(grpo + prime, "other_cpu_share"),
        "run_wall_s": round(raw["wall_s"], 1),
        "trimmed_boundaries": sum(1 for m in marks if m["trimmed"]),
        "grpo_rss_mb": [round(r) for r in grpo_rss],
    }


def run_variant(name: str, args, out_dir: Path) -> dict:
    result = out_dir / f"{name.replace('+', '_')}.json"
    run_dir = out_dir / f"run-{name.replace('+', '_')}"
    run_args = ["--output-dir", str(run_dir), "--overwrite"]  # a rerun with --keep DIR replaces its own run folders
    if args.prime_steps is not None:
        run_args += ["--set", f"prime.steps={args.prime_steps}"]
    if args.steps is not None:
        run_args += ["--max-steps", str(args.steps)]
    if args.eval_size is not None:
        run_args += ["--set", f"data.eval_size={args.eval_size}"]
    variant = VARIANTS[name]
    env = dict(os.environ, LOWVRAM_GRPO_HOST_MEMORY=variant.features, **dict(variant.env))
    run_args += ["--set", f"memory.host_allocator={variant.allocator}"]
    run_args += [part for extra in variant.sets for part in ("--set", extra)] + args.run_args
    # the child runs the CLI's main in its own process: preload as the CLI's restart does
    if variant.allocator == "mimalloc":
        from lowvram_grpo.core.allocator import mimalloc_library

        library = mimalloc_library()
        if library is None:
            raise SystemExit(f"variant {name} needs mimalloc: pip install --no-deps cmeel-mimalloc==3.4.3")
        env["LD_PRELOAD"] = library
    cmd = [sys.executable, "-m", "bench.host_memory", "--child", str(result), "--", *run_args]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    with open(out_dir / f"{name.replace('+', '_')}.log", "w") as log:
        code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                               cwd=Path(__file__).resolve().parent.parent)
    raw = json.loads(result.read_text())
    if code != 0:
        raise SystemExit(f"[{name}] the run failed (exit {code}); see {out_dir}")
    summary = summarize(raw, args.window)
    run_summary = json.loads((run_dir / "summary.json").read_text())
    summary["host_allocator_active"] = run_summary.get("host_allocator_active")
    summary["decode_merge_lora"] = (run_summary.get("resolved") or {}).get("decode_merge_lora")
    summary["held_out"] = {k: run_summary.get(k) for k in ("before", "primed", "after")}
    summary["losses_first_last"] = _losses(run_dir / "metrics.jsonl")
    print(f"[{name}] peak {summary['peak_rss_mb']} MB, slope {summary['rss_slope_mb_per_grpo_step_last']} , "
          f"GRPO step {summary['grpo_step_s_median']} s (clean {summary['grpo_step_s_median_clean']})", flush=True)
    return summary


def _losses(path: Path) -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [rows[0].get("loss"), rows[-1].get("loss")] if rows else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--variants", default="off,head+trim,head+trim+mimalloc",
                   help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--prime-steps", type=int, help="priming steps (default: the preset's)")
    p.add_argument("--steps", type=int, help="GRPO steps (default: the preset's)")
    p.add_argument("--eval-size", type=int, help="held-out questions (default: the preset's)")
    p.add_argument("--keep", type=Path,
                   help="keep each variant's run folder here (run-<variant>) instead of a temporary one; "
                        "a rerun replaces them")
    p.add_argument("--window", type=int, default=40, help="the RSS slope is taken over the last N GRPO steps")
    p.add_argument("--out", type=Path, default=RESULTS / "host_memory.json")
    p.add_argument("run_args", nargs="*", help="after --: more arguments for lowvram_grpo.run")
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.run_args)

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}: choose from {list(VARIANTS)}")
    results = {}
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        for name in names:
            results[name] = run_variant(name, args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="host-memory-") as tmp:
            for name in names:
                results[name] = run_variant(name, args, Path(tmp))
    ref = "off" if "off" in names else names[0]  # ratios against today's behaviour when it ran
    reference = results[ref]
    for name in names:
        r = results[name]
        r["grpo_step_time_vs_" + ref] = _ratio(r["grpo_step_s_median"], reference["grpo_step_s_median"])
        r["grpo_step_time_clean_vs_" + ref] = _ratio(r["grpo_step_s_median_clean"],
                                                     reference["grpo_step_s_median_clean"])
        r["prime_step_time_vs_" + ref] = _ratio(r["prime_step_s_median"], reference["prime_step_s_median"])
        r["peak_rss_vs_" + ref] = _ratio(r["peak_rss_mb"], reference["peak_rss_mb"])
    out = {
        "command": "python -m bench.host_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
        "job": {"preset": "smollm2_cpu (default)", "prime_steps": args.prime_steps or "preset's",
                "grpo_steps": args.steps or "preset's", "eval_size": args.eval_size or "preset's",
                "extra_args": args.run_args},
        "machine": {"cpus": NCPU, "python": sys.version.split()[0]},
        "clean_step_threshold_other_cpu_share": CLEAN,
        "variants": results,
    }
    print(f"wrote {write_report(args.out, out)}")
    return 0


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


if __name__ == "__main__":
    raise SystemExit(main())
