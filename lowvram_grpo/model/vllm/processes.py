"""The engine's OS processes: vLLM's EngineCore and Worker started with SIGINT blocked (a terminal's Ctrl-C
reaches only the trainer), ended with SIGTERM then SIGKILL, and a watchdog process that ends them when
the trainer itself is killed (SIGKILL runs no exit handler)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Optional

import psutil


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@contextlib.contextmanager
def sigint_blocked():
    """Block SIGINT (and SIGHUP) in this thread while vLLM spawns its processes: they inherit the mask (fork
    and exec keep it), so a terminal's Ctrl-C, or its hangup when it closes, never reaches them: the trainer
    stops at its next safe point and ends them (stops.py). A Ctrl-C meanwhile waits until the end."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker, when it is first started (vLLM's shared memory starts it), blocks
    # and then UNBLOCKS SIGINT in the calling thread: start it before, or it undoes our mask mid-start
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK,
                                 {signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, 'SIGHUP') else [])})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def environ(changes: dict[str, Optional[str]]):
    """Set (or with None, remove) environment variables for the block; restore them after."""
    def apply(values: dict[str, Optional[str]]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in changes}
    try:
        apply(changes)
        yield
    finally:
        apply(old)


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def end_processes(pids, timeout: float = 10.0) -> list[int]:
    """SIGTERM then, after `timeout`, SIGKILL the processes still alive. Returns those that were left."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


WATCHDOG_CODE = """
import os, signal, sys, time
pids = [int(p) for p in sys.argv[1:]]
if sys.stdin.read(1) == "":  # EOF: the trainer died without closing the engine (a close writes one byte)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
            time.sleep(0.1)
"""


def start_watchdog(pids: list[int]) -> subprocess.Popen:
    """A small process that ends `pids` if this process dies without `close()` (its stdin pipe then
    reaches EOF: any death, SIGKILL included). Its own session, so a Ctrl-C to our group passes it by."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG_CODE, *map(str, pids)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def engine_pids(pids) -> list[int]:
    """vLLM's own processes among new children: not multiprocessing's shared resource tracker, which
    serves the whole interpreter and ends with it."""
    keep = []
    for pid in pids:
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "resource_tracker" not in cmdline:
            keep.append(pid)
    return sorted(keep)
