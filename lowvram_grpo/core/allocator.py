"""The host allocator: which `malloc` this process runs on, and starting the CLI on mimalloc.

Why: on the CPU default job, glibc's malloc spreads its heap inside every GRPO step (the KV cache grows
by `torch.cat` every decoded token, and training shapes change every step), so a 135M model peaked at
3.5-4 GB RSS even with `malloc_trim` between steps (host_memory.py). mimalloc (Microsoft's allocator,
installed as a wheel: `cmeel-mimalloc`, pinned in requirements-cpu-nodeps.txt) reuses freed blocks
across sizes and returns unused pages to the OS by itself. Measured in bench/host_memory.py on the
whole default job: see docs/results.md (peak RSS, RSS slope per step, step time, against glibc).

How: an allocator has to be there before the process allocates anything, so it is preloaded
(`LD_PRELOAD`) into a fresh process. The CLI (`python -m lowvram_grpo.run`, `lowvram-grpo`), once the
settings are checked and decided (nothing heavy loaded, nothing written), restarts itself in place
(`os.execve` of the same command line) with mimalloc preloaded when resolve.py chose it
(`memory.host_allocator`: `auto` is mimalloc on a CPU run where the wheel is installed, on Linux). The
restarted process takes its library back out of `LD_PRELOAD`, so the processes it starts (vLLM's
engine, accelerate's workers) get the environment the user gave. A process that could not load it
runs on as before (never a second restart). From Python or a notebook the process already runs on
its allocator: the run says which one it has, and how to start on mimalloc (`mismatch_note`).

`release()` hands free memory back to the OS at step boundaries on either allocator: glibc's
`malloc_trim(0)`, mimalloc's `mi_collect(true)`.
"""
from __future__ import annotations

import ctypes
import os
import sys
from importlib import metadata
from typing import Mapping, Optional, Sequence

DISTRIBUTION = "cmeel-mimalloc"           # the wheel that ships libmimalloc.so
LIBRARY = "cmeel.prefix/lib/libmimalloc.so"  # its path inside the wheel's install prefix
RESTARTED = "LOWVRAM_GRPO_PRELOADED"        # set on the restarted process: the library it was started with

_process = None
_started_with: Optional[str] = None  # the library this process was restarted with (forget_preload)


def mimalloc_library(platform: str = sys.platform) -> Optional[str]:
    """The installed libmimalloc.so (from the cmeel-mimalloc wheel), or None (not installed, or not Linux:
    LD_PRELOAD is a Linux loader's feature)."""
    if not platform.startswith("linux"):
        return None

    try:
        path = metadata.distribution(DISTRIBUTION).locate_file(LIBRARY)
    except metadata.PackageNotFoundError:
        return None
    return str(path) if os.path.isfile(path) else None


def _symbols():
    global _process
    if _process is None:
        _process = ctypes.CDLL(None)  # the process's own symbols: a preloaded allocator's come first
    return _process


def active() -> str:
    """The allocator this process runs on: 'mimalloc' (preloaded), 'glibc', or 'other' (musl, macOS)."""
    symbols = _symbols()
    if hasattr(symbols, "mi_version"):
        return "mimalloc"
    return "glibc" if hasattr(symbols, "gnu_get_libc_version") and hasattr(symbols, "malloc_trim") else "other"


def release() -> bool:
    """Hand the allocator's free pages back to the OS: True when glibc released memory or mimalloc collected."""
    kind = active()
    if kind == "mimalloc":
        _symbols().mi_collect(ctypes.c_bool(True))
        return True
    if kind == "glibc":
        return bool(_symbols().malloc_trim(0))
    return False


def restart_environment(library: str, environ: Mapping[str, str]) -> Optional[dict]:
    """The environment to restart this process with `library` preloaded, or None when it must not:
    it is the restarted process already (the preload did not take; never a second restart)."""
    if environ.get(RESTARTED) or _started_with is not None:
        return None
    env = dict(environ)
    preload = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    env["LD_PRELOAD"] = ":".join([library] + [p for p in preload if p != library])
    env[RESTARTED] = library
    return env


def restart_with(library: str, argv: Sequence[str]) -> None:
    """Replace this process by `argv` (the same command line) with `library` preloaded. Returns only
    when it must not restart (see restart_environment)."""
    env = restart_environment(library, os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(argv), env)


def forget_preload(environ=os.environ) -> Optional[str]:
    """In the restarted process: take our library back out of LD_PRELOAD (the processes this one starts
    get the user's environment) and return it; None in a process that was not restarted."""
    global _started_with
    library = environ.pop(RESTARTED, None)
    if library is None:
        return None
    _started_with = library
    rest = [p for p in environ.get("LD_PRELOAD", "").split(":") if p and p != library]
    if rest:
        environ["LD_PRELOAD"] = ":".join(rest)
    else:
        environ.pop("LD_PRELOAD", None)
    return library


def mismatch_note(decided: str, library: Optional[str]) -> Optional[str]:
    """One line when this process does not run on the allocator the run resolved to (a notebook's
    kernel, a caller's process): what it runs on and how to start on mimalloc. None when it does."""
    running = active()
    if decided != "mimalloc" or running == "mimalloc":
        return None
    return (f"note: memory.host_allocator resolved to mimalloc but this process runs on {running} (it started "
            f"before the run; the CLI restarts itself on it): peak RSS will be higher; to start a Python process "
            f"or a notebook kernel on it, set LD_PRELOAD={library}")
