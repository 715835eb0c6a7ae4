"""Stops in every phase: SIGINT (Ctrl-C), SIGTERM (Colab, SLURM, a container runtime, `timeout`) and SIGHUP
(a closed terminal) become one clean `StopRequested` at the next safe point of whatever runs.

    with stops.handled():                 # commands.guarded (every command) and pipeline.run install it
        load()                            # outside `deferred`: a signal raises StopRequested at once
        with stops.deferred("after this batch"):
            for batch in batches:
                stops.check()             # a safe point: raises StopRequested once a signal came
                work(batch)

Inside `deferred` a signal is only recorded (and announced on stderr, with where the run will stop); the
next `check()` raises. A second Ctrl-C stops at once. Signals that were ignored when the process started
(`nohup`'s SIGHUP, SIGINT in a script's background job) stay ignored, as the shell meant. The exit code is
128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP: errors.Interrupted). The pipeline (which knows the
phase) turns StopRequested into the one line naming what is kept and the command that goes on; elsewhere
its own message says nothing was written and gives the same command line again. Nothing heavy is imported.
"""
from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from lowvram_grpo.core.errors import Interrupted

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

_received: Optional[int] = None   # the first signal of this stop, while the outermost `handled` runs
_installed = 0                    # nesting depth of `handled`
_deferred = 0                     # nesting depth of `deferred`
_where = "at the next safe point"  # what the notice says


def name(signum: int) -> str:
    return signal.Signals(signum).name


def same_command() -> str:
    """The command line of this process, to run again (`python -m lowvram_grpo.run ...`, `lowvram-grpo eval ...`)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    rest = argv[1:]
    if (rest and not rest[0].startswith("-") and not rest[0].endswith(".py")
            and Path(rest[0]).name.startswith("lowvram")):
        return shlex.join([Path(rest[0]).name, *rest[1:]])  # a console script: lowvram-grpo ...
    return shlex.join(["python", *rest])


class StopRequested(Interrupted):
    """A signal, raised at a safe point (or at once outside `deferred`). Exit 128 + signal."""
    def __init__(self, signum: int, message: Optional[str] = None):
        self.signum = signum
        super().__init__(message or f"stopped by {name(signum)}: nothing was written; run the same command again: "
                                    f"{same_command()}", signum)


def received() -> Optional[int]:
    """The signal that asked for a stop, or None."""
    return _received


def check() -> None:
    """A safe point: raise StopRequested when a signal came."""
    if _received is not None:
        raise StopRequested(_received)


def _handle(signum, frame):
    global _received
    if _received is not None:
        if signum == signal.SIGINT:
            raise StopRequested(_received)  # a second Ctrl-C: stop at once
        return
    _received = signum
    if _deferred:
        print(f"\n{name(signum)}: stopping {_where} (Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        return
    raise StopRequested(signum)


@contextlib.contextmanager
def handled():
    """Our handlers for SIGINT/SIGTERM/SIGHUP while the block runs (re-entrant; main thread only, as Python
    allows handlers nowhere else; a signal ignored at entry stays ignored). The outermost block starts
    and ends with no stop recorded, and ends with the handlers it found."""
    global _installed, _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    if _installed == 0:
        _received = None
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN:
                continue
            previous[sig] = signal.signal(sig, _handle)
    _installed += 1
    try:
        yield
    finally:
        _installed -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if _installed == 0:
            _received = None  # the stop is over: later work in this process (a notebook's next cell) runs


@contextlib.contextmanager
def deferred(where: Optional[str] = None, check_at_exit: bool = True):
    """Inside the block a signal is recorded and raised at the next `check()` (and at the block's end,
    unless `check_at_exit` is False: the caller acts on `received()` itself)."""
    global _deferred, _where
    before = _where
    _deferred += 1
    if where is not None:
        _where = where
    try:
        check()
        yield
        if check_at_exit:
            check()
    finally:
        _deferred -= 1
        _where = before


def set_where(where: str) -> None:
    """What the notice of a signal says about where the run will stop (`deferred` restores it)."""
    global _where
    _where = where
