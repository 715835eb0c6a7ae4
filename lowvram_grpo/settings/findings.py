"""One line of the doctor's report: what a check found and what to do (doctor.py and toolchain.py write them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One check: `status` ok | note | warn | BLOCK (the run cannot start), what was found, what to do."""
    status: str       # '' continues the line above (a table)
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.status:<5} {self.text}" + (f" -> {self.fix}" if self.fix else "")


def ok(text: str) -> Line:
    return Line("ok", text)


def note(text: str) -> Line:
    return Line("note", text)


def warn(text: str, fix: str) -> Line:
    return Line("warn", text, fix)


def block(text: str, fix: str) -> Line:
    return Line("BLOCK", text, fix)
