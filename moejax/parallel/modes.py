"""Adaptive parallelism (Tutel): one stored weight layout, three ways to run the experts.

Stored layout (`moejax.parallel.mesh`): experts' `E` over `expert` (G = E / N local experts), `F`
over `model`. Per call the layer picks a mode (`MODES` names them); the stored weights never move,
only per-call views:

- `"expert"` (expert parallel): tokens travel to the experts (a dispatcher: capacity all-to-all,
  bounded dropless all-to-all, or all-gather + reduce-scatter); weights stay where they are.
- `"data"` (data-parallel experts, ZeRO-3 style): each device all-gathers all `E` experts' weights
  over `expert` and runs them on its own tokens; no token exchange. Its gradient is the transpose
  of the all-gather, a reduce-scatter back into the stored layout.
- `"tensor"` (tensor-parallel experts): one all-to-all re-slices the weights from `[G, D, F/M]` to
  `[E, D, F/(M N)]` (all experts, a slice of F); tokens are all-gathered over `expert`, each
  device computes its F slice for every token, and a reduce-scatter sums the slices.

Per-call communication (elements per device, N expert devices, T local tokens, W = E D F / M
stored expert weights of one projection, P projections (3 gated, 2 otherwise)): see
`moejax.parallel.traffic`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from moejax.parallel import _collectives as col

Mode = Literal["expert", "data", "tensor"]
MODES: tuple[str, ...] = Mode.__args__
# Which dim of each expert parameter is F (None: no F dim). E is dim 0 everywhere.
_F_DIM = {"w_gate": 2, "w_up": 2, "w_down": 1, "b_gate": 1, "b_up": 1, "b_down": None}


def experts_view(experts: dict, mode: str, axes: col.MeshAxes) -> dict:
    """The expert parameters one device computes with, in `mode`, from its stored shards.

    Args:
      experts: this device's stored `experts/...` shards (`[G, D, F/M]` etc.).
      mode: `"expert"`, `"data"` or `"tensor"`.
      axes: the mesh axes.

    Returns:
      `"expert"`: the shards as stored; `"data"`: all `E` experts, `[E, D, F/M]`; `"tensor"`: all
      `E` experts on this device's slice of F, `[E, D, F/(M N)]`. `b_down` (no F dim, so it
      would be summed once per partial) is zeroed on all but one device of each partial sum.
    """
    if mode not in MODES:
        raise ValueError(f"Strategy.mode={mode!r}: must be one of {MODES}")
    first = col.axis_index(axes.model) == 0
    if mode == "tensor":
        first = first & (col.axis_index(axes.expert) == 0)
    out = {}
    for name, w in experts.items():
        if mode == "data" or (mode == "tensor" and _F_DIM[name] is None):
            w = col.all_gather(w, axes.expert, dim=0)
        elif mode == "tensor" and axes.expert is not None:
            w = jax.lax.all_to_all(w, axes.expert, _F_DIM[name], 0, tiled=True)
        if name == "b_down":
            w = jnp.where(first, w, jnp.zeros_like(w))
        out[name] = w
    return out
