"""Change detector of the placement controller: abrupt routing shifts, confirmed step by step.

Shape letters: ``L`` layers, ``E`` experts.

The controller re-plans a layer on a schedule, from an EMA of its counts; an abrupt shift of
the routing would be fitted late, on an average that still remembers the old routing. The
detector tests every step, in O(P) per layer, whether the layer's current placement is more than
``1 + react_gain`` times as imbalanced on the raw counts as its *base*: the imbalance the last
plan left it with (``settled``) and, when the raw counts exceed that, also the imbalance on the
EMA so far (a router drifting at the EMA's pace is no shift). ``react_steps`` such steps in a
row, against the base fixed at the streak's first step, confirm a change; with ``react_urgent``
one step above ``1 + react_urgent`` times the base does. A confirmed layer's new EMA is the mean
of the streak's counts, its forecast window starts with the streak (the steps before it are of
the old routing), and the controller checks it at once.

Plain numpy; no jax.
"""

from __future__ import annotations

import numpy as np

from moejax.placement.table import Placement


class ChangeDetector:
    """Per-layer streaks of shifted steps (module docstring).

    Args:
      num_layers: ``L``.
      react_gain: shift threshold (relative to the base); None: off (``update`` returns {}).
      react_steps: shifted steps in a row that confirm a change.
      react_urgent: None, or the threshold above which one step confirms.
    """

    def __init__(
        self,
        num_layers: int,
        react_gain: float | None,
        react_steps: int,
        react_urgent: float | None,
    ):
        self.react_gain, self.react_steps, self.react_urgent = react_gain, react_steps, react_urgent
        self._shifted: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # raw counts
        self._base = [1.0] * num_layers  # imbalance a streak of shifted steps is measured against

    def update(
        self,
        placements: list[Placement],
        counts: np.ndarray,
        ema: np.ndarray | None,
        settled: list[float],
    ) -> dict[int, np.ndarray]:
        """Takes one step's ``counts [L, E]``, before the EMA ``[L, E]`` (None before the first
        step) takes them; ``settled`` is the imbalance each layer's last plan left.

        Returns:
          ``{layer: the streak's counts [n, E]}`` (the ``n`` shifted steps, oldest first) for
          the layers whose change is confirmed now (their streaks start afresh).
        """
        changed = {}
        if self.react_gain is None:
            return changed
        for layer, placement in enumerate(placements):
            shifted, raw = self._shifted[layer], placement.imbalance(counts[layer])
            if not shifted:  # a new streak is measured against the EMA before it
                base = max(1.0, settled[layer])
                if ema is not None and raw > base * (1.0 + self.react_gain):
                    base = max(base, placement.imbalance(ema[layer]))
                self._base[layer] = base
            if raw <= self._base[layer] * (1.0 + self.react_gain):
                shifted.clear()
                continue
            shifted.append(counts[layer].copy())
            urgent = self.react_urgent is not None and raw > self._base[layer] * (
                1.0 + self.react_urgent
            )
            if len(shifted) >= self.react_steps or urgent:
                changed[layer] = np.stack(shifted)
                shifted.clear()
        return changed

    def reset(self, layer: int) -> None:
        """Drops ``layer``'s streak (its placement changed: a streak is against one layout)."""
        self._shifted[layer].clear()

    def state_dict(self) -> dict:
        """JSON-serialisable streaks and bases (``load_state_dict`` restores them exactly)."""
        return {
            "shifted": [[c.tolist() for c in layer] for layer in self._shifted],
            "shift_base": list(self._base),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()``."""
        self._shifted = [[np.asarray(c, np.float64) for c in layer] for layer in state["shifted"]]
        self._base = [float(x) for x in state["shift_base"]]
