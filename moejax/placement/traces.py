"""Routing traces: per-step, per-layer expert counts, synthetic or recorded.

A trace is an int64 array ``counts[steps, L, E]``: ``counts[t, l, e]`` is the number of token
assignments (rows, ``T·K`` per device summed over all devices) that layer ``l`` routed to expert
``e`` at step ``t``.

Recorded-trace file formats (written by the training loop, read by ``load_trace``):

* ``.npy``: the array itself, shape ``[steps, L, E]`` (or ``[steps, E]`` for one layer), any
  non-negative integer (or integral float) dtype. Write with ``np.save(path, counts)``.
* ``.jsonl``: one JSON object per step, in step order, with a field ``"expert_counts"``: a list
  of ``L`` per-layer lists of ``E`` ints, e.g. ``{"step": 12, "expert_counts": [[3, 0, 5], ...]}``.
  Other fields (such as ``"step"``) are ignored.

Synthetic traces draw each step's counts as a multinomial sample of ``tokens_per_step`` rows
over the expert probabilities (so they carry sampling noise; top-k's "K distinct experts per
token" is ignored). Generators are seeded and return ``[steps, L, E]`` int64. Zipf traces
shuffle which expert gets which rank (seeded, independently per layer) so that the hot experts
are not all on device 0 of the static placement.
"""

from __future__ import annotations

import json
import os

import numpy as np


def _check(steps: int, num_experts: int, tokens_per_step: int, num_layers: int) -> None:
    for name, value in (
        ("steps", steps),
        ("num_experts", num_experts),
        ("tokens_per_step", tokens_per_step),
        ("num_layers", num_layers),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")


def zipf_probs(num_experts: int, s: float) -> np.ndarray:
    """``[E]`` Zipf(s) probabilities by rank: ``p_k ∝ 1 / (k + 1)^s`` (s = 0 is uniform)."""
    if s < 0:
        raise ValueError(f"s must be >= 0, got {s!r}")
    p = 1.0 / np.arange(1, num_experts + 1) ** s
    return p / p.sum()


def zipf_exponent_for(num_experts: int, hot_ratio: float) -> float:
    """Zipf exponent ``s`` at which the hottest of ``E`` experts gets ``hot_ratio`` x the mean load.

    With a fixed ``s`` the hottest expert's share shrinks only like ``1 / H(E, s)``, so its load
    relative to the mean grows with ``E`` (s = 1: 2.8x at E = 16, 230x at E = 4096). Calibrating
    ``s`` per ``E`` keeps the skew comparable across scales. Solved by bisection on ``s``.

    Args:
      num_experts: ``E >= 2``.
      hot_ratio: target ``p_max · E`` in ``(1, E)``.

    Returns:
      The exponent ``s``.
    """
    if num_experts < 2 or not 1.0 < hot_ratio < num_experts:
        raise ValueError(f"hot_ratio must lie in (1, {num_experts}), got {hot_ratio!r}")
    lo, hi = 0.0, 1.0
    while zipf_probs(num_experts, hi)[0] * num_experts < hot_ratio:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (
            (mid, hi) if zipf_probs(num_experts, mid)[0] * num_experts < hot_ratio else (lo, mid)
        )
    return 0.5 * (lo + hi)


def _sample(rng: np.random.Generator, tokens: int, probs: np.ndarray) -> np.ndarray:
    return rng.multinomial(tokens, probs).astype(np.int64)


def balanced(
    steps: int, num_experts: int, tokens_per_step: int, *, num_layers: int = 1, seed: int = 0
) -> np.ndarray:
    """Stationary uniform routing with multinomial noise; returns ``[steps, L, E]``."""
    return zipf(steps, num_experts, tokens_per_step, s=0.0, num_layers=num_layers, seed=seed)


def zipf(
    steps: int,
    num_experts: int,
    tokens_per_step: int,
    *,
    s: float = 1.0,
    num_layers: int = 1,
    seed: int = 0,
) -> np.ndarray:
    """Stationary Zipf(s) routing (ranks shuffled per layer) with noise; ``[steps, L, E]``.

    Args:
      steps: number of steps.
      num_experts: ``E``.
      tokens_per_step: rows routed per step and layer (``N·T·K``).
      s: Zipf exponent (0 = uniform; larger = more skewed).
      num_layers: ``L``.
      seed: RNG seed.

    Returns:
      ``[steps, L, E]`` int64 counts; every step of a layer sums to ``tokens_per_step``.
    """
    _check(steps, num_experts, tokens_per_step, num_layers)
    rng = np.random.default_rng(seed)
    base = zipf_probs(num_experts, s)
    probs = [base[rng.permutation(num_experts)] for _ in range(num_layers)]
    out = np.empty((steps, num_layers, num_experts), np.int64)
    for t in range(steps):
        for layer in range(num_layers):
            out[t, layer] = _sample(rng, tokens_per_step, probs[layer])
    return out


def drifting_zipf(
    steps: int,
    num_experts: int,
    tokens_per_step: int,
    *,
    s: float = 1.0,
    shift_every: int = 100,
    shift: int | None = None,
    num_layers: int = 1,
    seed: int = 0,
) -> np.ndarray:
    """Zipf(s) routing whose hot set rotates: every ``shift_every`` steps the rank-to-expert map
    rolls by ``shift`` experts (default ``max(1, E // 4)``), so other experts become hot.

    Args:
      steps: number of steps.
      num_experts: ``E``.
      tokens_per_step: rows routed per step and layer.
      s: Zipf exponent.
      shift_every: steps between rotations of the hot set.
      shift: experts the rank map rolls by at each rotation.
      num_layers: ``L``.
      seed: RNG seed.

    Returns:
      ``[steps, L, E]`` int64 counts.
    """
    _check(steps, num_experts, tokens_per_step, num_layers)
    if shift_every < 1:
        raise ValueError(f"shift_every must be >= 1, got {shift_every!r}")
    shift = max(1, num_experts // 4) if shift is None else shift
    rng = np.random.default_rng(seed)
    base = zipf_probs(num_experts, s)
    ranks = [rng.permutation(num_experts) for _ in range(num_layers)]
    out = np.empty((steps, num_layers, num_experts), np.int64)
    for t in range(steps):
        roll = (t // shift_every) * shift
        for layer in range(num_layers):
            out[t, layer] = _sample(rng, tokens_per_step, base[np.roll(ranks[layer], roll)])
    return out


def synthetic_traces(
    steps: int, num_devices: int, rows_per_device: int, hot_ratio: float = 4.0, seed: int = 0
) -> dict[str, np.ndarray]:
    """The simulator's three synthetic one-layer traces at ``N = num_devices``, by name:
    ``balanced``, ``zipf(s=..)`` and ``drifting(s=..)`` (the hot set rotating every
    ``steps // 4`` steps), with ``E = 2N`` experts, ``N * rows_per_device`` rows a step, and the
    Zipf exponent calibrated so that the hottest expert gets ``hot_ratio`` x the mean load
    (``zipf_exponent_for``: a fixed exponent would make the skew grow with ``E``).

    Returns:
      name -> ``[steps, 1, 2N]`` int64 counts.
    """
    e, tokens = 2 * num_devices, num_devices * rows_per_device
    s = zipf_exponent_for(e, hot_ratio)
    common = dict(num_layers=1, seed=seed)
    return {
        "balanced": balanced(steps, e, tokens, **common),
        f"zipf(s={s:.2f})": zipf(steps, e, tokens, s=s, **common),
        f"drifting(s={s:.2f})": drifting_zipf(
            steps, e, tokens, s=s, shift_every=max(1, steps // 4), **common
        ),
    }


def _as_trace(counts: np.ndarray, source: str) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim == 2:
        counts = counts[:, None, :]
    if counts.ndim != 3 or 0 in counts.shape:
        raise ValueError(f"trace {source} must have shape [steps, L, E], got {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0) or np.any(counts != np.round(counts)):
        raise ValueError(f"trace {source} must hold non-negative integer counts")
    return counts.astype(np.int64)


def load_trace(path: str | os.PathLike) -> np.ndarray:
    """Loads a recorded trace (``.npy`` or ``.jsonl``, see the module docstring).

    Args:
      path: file path; the suffix picks the format.

    Returns:
      ``[steps, L, E]`` int64 counts.
    """
    path = os.fspath(path)
    if path.endswith(".npy"):
        return _as_trace(np.load(path, allow_pickle=False), path)
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "expert_counts" not in record:
                    raise ValueError(f"{path}:{lineno}: missing field 'expert_counts'")
                rows.append(record["expert_counts"])
        return _as_trace(np.asarray(rows), path)
    raise ValueError(f"trace path must end in .npy or .jsonl, got {path!r}")


def save_trace(path: str | os.PathLike, counts: np.ndarray) -> None:
    """Writes ``counts [steps, L, E]`` as ``.npy`` or ``.jsonl`` (formats of ``load_trace``)."""
    path = os.fspath(path)
    counts = _as_trace(counts, path)
    if path.endswith(".npy"):
        np.save(path, counts)
    elif path.endswith(".jsonl"):
        with open(path, "w") as f:
            for step, layers in enumerate(counts.tolist()):
                f.write(json.dumps({"step": step, "expert_counts": layers}) + "\n")
    else:
        raise ValueError(f"trace path must end in .npy or .jsonl, got {path!r}")
