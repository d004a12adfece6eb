"""The input error of the commands (a module of its own: `train_inputs` and `_distributed` both
raise it)."""

from __future__ import annotations


class InputError(ValueError):
    """A bad flag value (reported in one line, like the library's input errors)."""
