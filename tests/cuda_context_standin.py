"""A CUDA stand-in for one process on a machine without a GPU: torch.cuda says one card is present, and every
call that would start CUDA in this process is recorded (and refused) instead.

    python tests/cuda_context_standin.py RECORD -m MODULE [ARGS ...]    # MODULE run as `python -m MODULE ARGS`
    python tests/cuda_context_standin.py RECORD -c CODE

The boundary is torch's CUDA initialisation: `torch.cuda._lazy_init`, which every device call passes through
before it reaches the driver (get_device_properties, mem_get_info via cudart(), current_device, set_device,
synchronize, ...) and which torch's C++ calls by name before it makes a CUDA tensor. On a card, that
initialisation is what the first such call pays; mem_get_info, memory statistics and any tensor then hold a
context on the device until the process exits. Counted conservatively: every initialisation is recorded as a
context. `is_available()` (True here) and `device_count()` (1) are queries the driver answers without a context
(cudaGetDeviceCount, or NVML): recorded as queries, not contexts.

RECORD gets one JSON line per event: {"event": "installed"} first, then {"event": "query"|"context", "call",
"site"} where site is the innermost frame of the project (bench/, lowvram_grpo/) that led to the call. The stand-in
lives in this process only: child processes start without it.
"""
from __future__ import annotations

import json
import runpy
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        try:
            relative = path.resolve().relative_to(REPO)
        except ValueError:
            continue
        if relative.parts and relative.parts[0] in ("bench", "lowvram_grpo"):
            return f"{relative}:{frame.lineno} in {frame.name}"
    return "outside the project"


def install(record: Path) -> None:
    import torch

    def write(event: str, call: str = "") -> None:
        with open(record, "a") as out:
            out.write(json.dumps({"event": event, "call": call, "site": _site() if call else ""}) + "\n")

    original = torch.cuda._lazy_init

    def is_available() -> bool:
        write("query", "torch.cuda.is_available")
        return True

    def device_count() -> int:
        write("query", "torch.cuda.device_count")
        return 1

    def lazy_init() -> None:
        write("context", "torch.cuda._lazy_init")
        raise RuntimeError("CUDA stand-in (tests/cuda_context_standin.py): this call would start CUDA in this "
                           "process and hold a context on the card")

    torch.cuda.is_available = is_available
    torch.cuda.device_count = device_count
    # the name torch.cuda's own functions and its submodules (memory, random, ...) call it by
    for name, module in list(sys.modules.items()):
        if (name == "torch.cuda" or name.startswith("torch.cuda.")) and getattr(module, "_lazy_init", None) is original:
            module._lazy_init = lazy_init
    write("installed")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        sys.exit("usage: python tests/cuda_context_standin.py RECORD -m MODULE [ARGS ...] | RECORD -c CODE")
    record, how, target, rest = Path(argv[0]), argv[1], argv[2], argv[3:]
    sys.path.insert(0, str(REPO))  # as `python -m` from the checkout's root finds bench/ and lowvram_grpo/
    install(record)
    if how == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main(sys.argv[1:])
