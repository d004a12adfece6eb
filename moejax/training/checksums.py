"""CRC-32 checksums of pytrees of arrays, and one host pass that checks them and counts NaN/Inf.

Used by training checkpoints (`moejax.training.checkpoint`: a `checksums` item beside the state)
and converted Hugging Face models (`moejax.interop.hf`: `checksums.json`). Arrays are named by
their pytree path (`params.layers[1].moe.experts.w_up`) and checksummed over their bytes in C
order, as saved.
"""

from __future__ import annotations

import json
import zlib

import jax
import numpy as np

CHECKSUM_FORMAT = "moejax-checksums/1"


def leaf_name(path) -> str:
    """`params.layers[1].moe.experts.w_up`: a readable name of a pytree key path."""
    out = ""
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            out += f"[{key.idx}]"
        elif isinstance(key, jax.tree_util.DictKey):
            out += f".{key.key}"
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out += f".{key.name}"
        else:
            out += f".{key}"
    return out.lstrip(".")


def array_checksum(x: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order."""
    x = np.ascontiguousarray(x)
    return zlib.crc32(x.reshape(-1).view(np.uint8))


def meta_checksum(meta: dict) -> int:
    """CRC-32 of `meta` as canonical JSON (as read back: tuples are lists)."""
    return zlib.crc32(json.dumps(json.loads(json.dumps(meta)), sort_keys=True).encode())


def state_checksums(tree) -> dict:
    """`{name: [crc32, shape, dtype]}` of every array of `tree` (None where it spans processes)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            out[leaf_name(path)] = None
            continue
        host = np.asarray(jax.device_get(leaf))
        out[leaf_name(path)] = [array_checksum(host), list(host.shape), str(host.dtype)]
    return out


def check_arrays(tree, expected: dict | None, *, partial: bool = False):
    """One pass over the arrays of `tree` on the host: `(mismatched, nonfinite)`.

    Args:
      tree: a pytree of arrays (its leaf names as `leaf_name`).
      expected: `{name: [crc32, shape, dtype]}` (`state_checksums`), or None (not checked).
      partial: `tree` holds only some of `expected`'s arrays (e.g. the params of a state):
        names it lacks are not mismatches.

    Returns:
      `mismatched`: names whose checksum, shape or dtype differ from `expected` (or that one
      side lacks); `nonfinite`: `(name, count, size)` of every float array holding NaN or Inf.
      Arrays that span processes are checked for neither (no host copy on one process).
    """
    got, nonfinite = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = leaf_name(path)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            got[name] = None
            continue
        host = np.asarray(jax.device_get(leaf))
        got[name] = [array_checksum(host), list(host.shape), str(host.dtype)]
        if jax.numpy.issubdtype(host.dtype, jax.numpy.inexact):
            bad = host.size - int(np.count_nonzero(np.isfinite(host)))
            if bad:
                nonfinite.append((name, bad, host.size))
    mismatched = []
    if expected is not None:
        names = set(got) if partial else set(got) | set(expected)
        for name in sorted(names):
            want, have = expected.get(name, "<missing>"), got.get(name, "<missing>")
            if want is None or have is None:  # spans processes (written or restored)
                continue
            if want != have:
                mismatched.append(name)
    return mismatched, nonfinite


def nonfinite_message(where: str, nonfinite: list) -> str:
    """One line naming the first array holding NaN/Inf, its count, and how many more."""
    name, bad, size = nonfinite[0]
    more = f" (and {len(nonfinite) - 1} more arrays)" if len(nonfinite) > 1 else ""
    return f"{where}: array {name}: {bad} of {size} values are NaN or Inf{more}"
