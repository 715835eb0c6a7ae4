"""The package's commands' plumbing: the one place errors become exit codes.

`guarded(body)` runs a command's body (run, doctor, eval, report, baseline, the first-run kit) with
SIGINT/SIGTERM/SIGHUP handled (stops.py: a stop at the next safe point, exit 128 + signal) and turns a
LowvramError (errors.py: every error a user can meet, with its exit code) into its one `error:` line and
exit code; `ArgumentParser` gives bad arguments the same one line and exit 2. Nothing heavy is imported.
"""
from __future__ import annotations

import argparse
import os
import sys

from lowvram_grpo.core import stops
from lowvram_grpo.core.errors import LowvramError


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
    --debug or LOWVRAM_GRPO_DEBUG=1). SIGINT/SIGTERM/SIGHUP are handled while `body` runs (stops.py): a
    stop at the next safe point, exit 128 + signal."""
    try:
        with stops.handled():
            try:
                return body()
            except Exception as exc:  # a library that turned a stop into an error of its own: the stop's line
                if stops.received() is None or isinstance(exc, LowvramError):
                    raise
                raise stops.StopRequested(stops.received()) from None
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
