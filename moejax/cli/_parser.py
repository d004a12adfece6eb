"""The argument parser of the commands: argparse whose own errors are one line."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse whose own errors (a missing argument, an unknown flag, a non-int `--steps`) are
    one line on stderr and exit code 2, like the commands' input errors."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")
