"""The argument parser of the commands: argparse whose own errors are one line, and value types
that refuse what argparse alone would take silently (a `0` read as unset, a negative count, a
NaN)."""

from __future__ import annotations

import argparse
import math


class OneLineParser(argparse.ArgumentParser):
    """argparse whose own errors (a missing argument, an unknown flag, a non-int `--steps`) are
    one line on stderr and exit code 2, like the commands' input errors."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An `int >= 1` (argparse `type=`): `0` and negatives are errors, not "unset"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: need an integer >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An `int >= 0` (argparse `type=`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: need an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite `float > 0` (argparse `type=`): NaN, inf, 0 and negatives are errors."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: need a finite number > 0")
    return value
