"""Where a run's peak resident memory is set: the run's RSS high-water mark, phase by phase.

    python -m bench.rss_timeline --out bench/results/rss_timeline.json [-- RUN ARGS]

Runs `python -m lowvram_grpo.run RUN ARGS` (no RUN ARGS: the default job, the README's first command) in a child
process and reads its /proc/PID/status every --interval seconds: VmRSS (now) and VmHWM (the kernel's high-water
mark, so a spike between two readings is not lost, only attributed to the reading after it). Each reading is
attributed to the phase the run's output last named: the text before the first ':' of its last output line or
progress-bar update ("GRPO", "priming", ...), or the whole line. The record: the peak (VmHWM at the end, the
figure ru_maxrss reports), the phase in which the high-water mark last rose, each phase's highest RSS and its
rise of the high-water mark, and the run's summary.json numbers. Linux only; run it alone (`flock
/tmp/lowvram-cpu.lock ...`): the figures are this machine's (bench.harness.machine in the record).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import machine, write_report


def status_kib(pid: int) -> dict:
    """{'VmRSS': KiB, 'VmHWM': KiB} of a live process; {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def phase_of(segment: str) -> str | None:
    """The phase an output segment names: the text before its first ':' (a progress bar's name), else the line."""
    text = segment.strip()
    if not text or segment.startswith((" ", "\t")) or text.startswith(("warning", "[", "<", "/")) or "Warning" in text:
        return None  # indented lines (tracebacks of warnings, settings), warnings, tags of a printed sample
    head = text.split(":", 1)[0].strip()
    return head[:60] if head else None


def timeline(run_args: list[str], interval: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "lowvram_grpo.run", *run_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    current = {"phase": "start"}
    tail: list[str] = []

    def read():  # progress bars rewrite their line with '\r': each rewrite is a segment
        buffer = ""
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            buffer += chunk.decode(errors="replace")
            *done, buffer = buffer.replace("\r", "\n").split("\n")
            for segment in done:
                phase = phase_of(segment)
                if phase:
                    current["phase"] = phase
                    if not tail or tail[-1] != phase:
                        tail.append(phase)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    phases: dict[str, dict] = {}
    hwm = 0
    peak_phase = None
    while proc.poll() is None:
        now = status_kib(proc.pid)
        if now:
            phase = phases.setdefault(current["phase"], {"max_rss_mib": 0.0, "hwm_rise_mib": 0.0,
                                                         "first_s": round(time.monotonic() - began, 1)})
            phase["max_rss_mib"] = max(phase["max_rss_mib"], round(now["VmRSS"] / 1024, 1))
            if now["VmHWM"] > hwm:
                phase["hwm_rise_mib"] = round(phase["hwm_rise_mib"] + (now["VmHWM"] - hwm) / 1024, 1)
                hwm, peak_phase = now["VmHWM"], current["phase"]
        time.sleep(interval)
    reader.join(timeout=5)
    return {"returncode": proc.returncode, "wall_s": round(time.monotonic() - began, 1),
            "peak_gib": round(hwm / 2**20, 3), "peak_set_in": peak_phase, "phases": phases,
            "phase_order": tail[:200]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/rss_timeline.json"))
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between readings")
    parser.add_argument("run_args", nargs="*", help="after --: the run's arguments (default: the default job)")
    args = parser.parse_args(argv)
    record = {"command": "python -m bench.rss_timeline " + " ".join(sys.argv[1:] if argv is None else argv),
              "settings": machine(), **timeline(args.run_args, args.interval)}
    output_dir = next((args.run_args[i + 1] for i, a in enumerate(args.run_args[:-1]) if a == "--output-dir"), None)
    summary = Path(output_dir) / "summary.json" if output_dir else None
    if summary is not None and summary.is_file():
        record["summary"] = {k: v for k, v in json.loads(summary.read_text()).items()
                             if k in ("steps", "train_seconds", "total_seconds", "before", "primed", "after",
                                      "paired_changes")}
    write_report(args.out, record)
    print(f"peak {record['peak_gib']} GiB, set in phase {record['peak_set_in']!r}; per phase (max RSS MiB, high-water "
          f"rise MiB): " + ", ".join(f"{k} {v['max_rss_mib']}/{v['hwm_rise_mib']}"
                                     for k, v in record["phases"].items()))
    return 0 if record["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
