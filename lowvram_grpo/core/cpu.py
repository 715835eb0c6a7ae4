"""The host CPU's feature flags, read once from /proc/cpuinfo: what tells CPUs of one model name apart (native bf16,
VNNI). An empty set where there is no /proc/cpuinfo (not Linux)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset:
    """The first `flags` line of /proc/cpuinfo as a set (e.g. {'avx2', 'avx512_vnni', ...}); empty if unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:  # not Linux
        pass
    return frozenset()
