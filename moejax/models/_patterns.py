"""Which layers' FFN is MoE: Hugging Face configs' spellings read into one per-layer list, and
the runs of repeated units `lm_forward(scan_layers=True)` scans.

Hugging Face configs say where the MoE layers sit in five ways (transformers 4.5x-5.x):

| field | family | layer `i` is MoE when |
|---|---|---|
| `mlp_layer_types` | transformers 5 | entry `i` is `"sparse"` (or `"moe"`); `"dense"` otherwise |
| `first_k_dense_replace` | DeepSeek-V2/V3, Kimi K2, GLM-4.5 | `i >= first_k_dense_replace` |
| `moe_layer_freq` | DeepSeek-V2/V3 | and `i % moe_layer_freq == 0` |
| `mlp_only_layers` | Qwen2-MoE, Qwen3-MoE | `i` is not listed |
| `decoder_sparse_step` | Qwen2-MoE, Qwen3-MoE, (`moe_every`) | and `(i + 1) % step == 0` |

`mlp_layer_types_of` combines them (a layer is MoE only where every field present says so,
as the reference modeling files test them together) and refuses what it cannot read, naming
the field.
"""

from __future__ import annotations

from typing import NamedTuple

_SPARSE = {"sparse": "moe", "moe": "moe", "dense": "dense"}


def mlp_layer_types_of(config: dict) -> tuple[str, ...]:
    """The FFN kind of every layer (`"dense"` or `"moe"`) from a Hugging Face `config.json`
    dict (the table in the module docstring).

    Args:
      config: the config's fields; `num_hidden_layers` is required.

    Returns:
      A tuple of `num_hidden_layers` entries, for `LMConfig(mlp_layer_types=...)`.

    Raises:
      ValueError: naming the field whose value cannot be read (an unknown entry, a count
        beyond the layers, a step that is not a positive int).

    >>> mlp_layer_types_of({"num_hidden_layers": 4, "first_k_dense_replace": 1})
    ('dense', 'moe', 'moe', 'moe')
    >>> mlp_layer_types_of({"num_hidden_layers": 4, "mlp_only_layers": [0, 2]})
    ('dense', 'moe', 'dense', 'moe')
    """
    n = config.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"num_hidden_layers={n!r}: must be a positive int")
    moe = [True] * n
    if (types := config.get("mlp_layer_types")) is not None:
        if not isinstance(types, list | tuple) or len(types) != n:
            raise ValueError(
                f"mlp_layer_types={types!r}: must be a list of num_hidden_layers={n} entries"
            )
        if bad := sorted({t for t in types if t not in _SPARSE}, key=str):
            raise ValueError(
                f"mlp_layer_types: entries {bad} are not supported (known: {sorted(_SPARSE)})"
            )
        moe = [m and _SPARSE[t] == "moe" for m, t in zip(moe, types, strict=True)]
    if (k := config.get("first_k_dense_replace")) is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(
                f"first_k_dense_replace={k!r}: must be an int from 0 to num_hidden_layers={n}"
            )
        moe = [m and i >= k for i, m in enumerate(moe)]
    if (freq := config.get("moe_layer_freq")) is not None:
        _step("moe_layer_freq", freq, n)
        moe = [m and i % freq == 0 for i, m in enumerate(moe)]
    if only := config.get("mlp_only_layers"):
        if not isinstance(only, list | tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in only
        ):
            raise ValueError(
                f"mlp_only_layers={only!r}: must be a list of layer indices from 0 to {n - 1}"
            )
        moe = [m and i not in only for i, m in enumerate(moe)]
    if (step := config.get("decoder_sparse_step")) is not None:
        _step("decoder_sparse_step", step, n)
        moe = [m and (i + 1) % step == 0 for i, m in enumerate(moe)]
    return tuple("moe" if m else "dense" for m in moe)


def _step(name: str, value, n: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= n:
        raise ValueError(f"{name}={value!r}: must be an int from 1 to num_hidden_layers={n}")


class ScanRun(NamedTuple):
    """Layers `[start, start + unit * repeats)`: `repeats` copies of the `unit` layers from
    `start`, scanned as one `jax.lax.scan` step per copy."""

    start: int
    unit: int
    repeats: int


def scan_runs(kinds: tuple[str, ...], legacy_unit: int | None = None) -> tuple[ScanRun, ...]:
    """The runs of identical units `lm_forward(scan_layers=True)` scans; layers outside every
    run go unscanned.

    Greedy from the first layer: at each layer the unit (1 to half the rest) whose repeats
    cover the most layers, at least two repeats (the shortest unit on ties); where none
    repeats, that layer goes unscanned. `[dense, moe, moe]`: layer 0, then `[moe] x 2`;
    DeepSeek-V3's `[dense] x 3 + [moe] x 58`: two runs, so the program holds two blocks.

    Args:
      kinds: `LMConfig.mlp_kinds`.
      legacy_unit: with a `moe_every` pattern, its `u`: one run of `L // u` units from layer 0
        (also a single unit), the leftover dense layers unscanned.
    """
    n = len(kinds)
    if legacy_unit is not None:
        return (ScanRun(0, legacy_unit, n // legacy_unit),)
    runs, i = [], 0
    while i < n:
        best = None
        for u in range(1, (n - i) // 2 + 1):
            unit, r = kinds[i : i + u], 1
            while kinds[i + r * u : i + (r + 1) * u] == unit:
                r += 1
            if r >= 2 and (best is None or r * u > best.unit * best.repeats):
                best = ScanRun(i, u, r)
        if best is None:
            i += 1
        else:
            runs.append(best)
            i += best.unit * best.repeats
    return tuple(runs)
