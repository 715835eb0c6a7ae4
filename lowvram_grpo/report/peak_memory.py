"""The run's own peak memory: this process's ru_maxrss, and the phase of the run that set it.

    RUN_PEAK.enter("training")      # the pipeline, at each phase's start (GRPORun._enter)
    RUN_PEAK.facts()                # {'bytes': ..., 'gib': 1.245, 'phase': 'training'} for summary.json
    RUN_PEAK.text()                 # 'peak 1.24 GiB (training)': the progress line's last words, the report's line

ru_maxrss is the kernel's high-water mark of the process's resident memory: it only rises. Read at every phase's
start and at every look, a rise since the last reading happened in the phase that was current over that span, so the
phase named is the one in which the high-water mark last rose: the phase that set the peak, exactly, without
sampling. It counts this process alone (not pip, not a vLLM engine's own processes); a resumed run's is that of the
process that resumed it. Pure standard library: no torch.
"""
from __future__ import annotations

import resource
import sys
from typing import Optional

GIB = 1024 ** 3


def peak_rss_bytes() -> int:
    """This process's ru_maxrss in bytes (Linux reports KiB, macOS bytes)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024


class PeakMemory:
    """The high-water mark of this process's RSS and the phase in which it last rose (see the module's docstring)."""

    def __init__(self, phase: Optional[str] = None):
        self.phase = phase
        self.peak = peak_rss_bytes()
        self.set_in: Optional[str] = phase

    def look(self) -> int:
        """Read ru_maxrss now; a rise since the last reading is the current phase's. Returns the peak in bytes."""
        now = peak_rss_bytes()
        if now > self.peak:
            self.peak, self.set_in = now, self.phase
        return self.peak

    def enter(self, phase: str) -> None:
        """The run moves on to `phase`: what rose until now is the phase before's."""
        self.look()
        self.phase = phase

    def facts(self) -> dict:
        """summary.json's `peak_rss`: bytes, GiB (3 decimals) and the phase that set it (None: before any phase)."""
        self.look()
        return {"bytes": self.peak, "gib": round(self.peak / GIB, 3), "phase": self.set_in, "source": "ru_maxrss"}

    def text(self) -> str:
        """'peak 1.24 GiB (training)'."""
        self.look()
        return describe(self.peak / GIB, self.set_in)


def describe(gib: float, phase: Optional[str]) -> str:
    """'peak 1.24 GiB (training)': a peak as the progress line and the report say it."""
    return f"peak {gib:.2f} GiB" + (f" ({phase})" if phase else "")


RUN_PEAK = PeakMemory("loading")  # the process's: the run's phases move it on (pipeline.GRPORun._enter)
