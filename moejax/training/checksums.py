"""Checksums of pytrees of arrays, and one pass that checks them and counts NaN/Inf.

Used by training checkpoints (`moejax.training.checkpoint`: a `checksums` item beside the state)
and converted Hugging Face models (`moejax.interop.hf`: `checksums.json`). Arrays are named by
their pytree path (`params.layers[1].moe.experts.w_up`); a manifest maps each name to
`[checksum, shape, dtype]` under one `algorithm`, which one rule picks (`algorithm_for`): a
tree this process holds whole gets `"crc32"`, one with an array that spans processes
`"fmixsum64"`. Both are of the array's contents in C order, whatever its sharding; a manifest
is verified by its own algorithm wherever it is read (one process or several, any mesh).

- `"crc32"`: CRC-32 of the bytes, on the host. The host copy is one `device_get`, and zlib's
  CRC is the cheapest there is: 15 ms for the README main job's 39 MiB state, where compiling
  the device program of `"fmixsum64"` for it takes seconds on a CPU. An array that spans
  processes has no host copy on any one process: to verify a CRC-32 entry of one (a
  checkpoint written by one process, resumed by several) it is gathered to every host, one
  array at a time. (`null` entries, which multi-process checkpoints written before
  `"fmixsum64"` hold for such arrays, are not checked.)
- `"fmixsum64"`: computed on the devices, in one jitted program over the whole tree, so it is
  the same number whatever the sharding and however many processes hold the array, and every
  process gets it (a replicated value). Each element's bit pattern is cut into 32-bit words
  (`bool`, 1- and 2-byte types widened to one word, 8-byte types two, complex numbers their
  real and imaginary parts), in C order; word `i` of value `x` adds
  `fmix32(x ^ fmix32(i ^ seed))` (MurmurHash3's bijective finalizer) to a sum mod 2**32, for
  two seeds: the checksum is the two sums as one 64-bit integer. Each term is a bijection of
  its word, so a change to any one word always changes both sums; several changed words (or two
  swapped) leave both unchanged with a chance of about 2**-64. Modular sums do not depend on
  the order of addition: that is what makes the value sharding-independent (and exact). NaN/Inf
  are counted in the same program, so nothing is copied to a host.
"""

from __future__ import annotations

import functools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np

CHECKSUM_FORMAT = "moejax-checksums/1"
ALGORITHM = "fmixsum64"  # on the devices: trees that span processes
CRC32 = "crc32"  # on the host: trees this process holds whole
ALGORITHMS = (ALGORITHM, CRC32)
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


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
    """CRC-32 of an array's bytes in C order (the `"crc32"` algorithm)."""
    x = np.ascontiguousarray(x)
    return zlib.crc32(x.reshape(-1).view(np.uint8))


def meta_checksum(meta: dict) -> int:
    """CRC-32 of `meta` as canonical JSON (as read back: tuples are lists)."""
    return zlib.crc32(json.dumps(json.loads(json.dumps(meta)), sort_keys=True).encode())


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """`x`'s bit patterns as uint32 words `[*x.shape, k]` (k words per element, C order)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
        return _words(x).reshape(*x.shape[:-1], -1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)[..., None]
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)[..., None]
    if size in (1, 2):
        narrow = {1: jnp.uint8, 2: jnp.uint16}[size]
        return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)[..., None]
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: [..., 2]


def _flat_index(shape) -> jax.Array:
    """The C-order flat index (mod 2**32) of every position of `shape`, as uint32, without
    reshaping (a sharded array stays sharded: no gather)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _leaf_digest(x) -> jax.Array:
    """`[3]` uint32: the two sums of `x` and its count of NaN/Inf (0 for other dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    words = _words(x)
    index = _flat_index(words.shape)
    sums = [jnp.sum(_fmix32(words ^ _fmix32(index ^ jnp.uint32(s))), dtype=jnp.uint32)
            for s in _SEEDS]  # fmt: skip
    if jnp.issubdtype(x.dtype, jnp.inexact):
        bad = jnp.sum(~jnp.isfinite(x), dtype=jnp.uint32)
    else:
        bad = jnp.uint32(0)
    return jnp.stack([*sums, bad])


@functools.lru_cache(maxsize=64)
def _digest_fn(out_sharding):
    return jax.jit(lambda leaves: jnp.stack([_leaf_digest(x) for x in leaves]),
                   out_shardings=out_sharding)  # fmt: skip


def _replicated(sharding):
    """A replicated sharding on `sharding`'s devices (None: let jit choose)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def device_digests(tree) -> dict:
    """`{name: (checksum, nonfinite, shape, dtype)}` of every array of `tree`, computed on the
    devices holding it (module docstring, `"fmixsum64"`).

    One jitted program per set of devices the leaves live on (one, normally); with several
    processes every process must call it with the same tree (it is a collective), and every
    process gets every value.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups: dict = {}
    for path, leaf in flat:
        if not isinstance(leaf, jax.Array):
            leaf = jnp.asarray(leaf)
        key = tuple(sorted(d.id for d in leaf.sharding.device_set))
        groups.setdefault(key, []).append((leaf_name(path), leaf))
    out = {}
    for items in groups.values():
        leaves = [leaf for _, leaf in items]
        try:
            values = np.asarray(_digest_fn(_replicated(leaves[0].sharding))(leaves))
        except ValueError:  # the same devices in other orders (meshes): one leaf at a time
            values = np.concatenate(
                [np.asarray(_digest_fn(_replicated(x.sharding))([x])) for x in leaves]
            )
        for (name, leaf), (s1, s2, bad) in zip(items, values.astype(np.uint64), strict=True):
            dtype = str(leaf.dtype)
            out[name] = (int(s1) << 32 | int(s2), int(bad), list(leaf.shape), dtype)
    return {leaf_name(path): out[leaf_name(path)] for path, _ in flat}  # in tree order


def _spans_processes(leaf) -> bool:
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def algorithm_for(tree) -> str:
    """The algorithm a manifest of `tree` is written with (module docstring): `"fmixsum64"`
    if an array spans processes, else `"crc32"`. The same on every process of a run."""
    return ALGORITHM if any(_spans_processes(x) for x in jax.tree.leaves(tree)) else CRC32


def state_checksums(tree, algorithm: str | None = None) -> dict:
    """`{name: [checksum, shape, dtype]}` of every array of `tree`, by `algorithm` (default
    `algorithm_for(tree)`); with several processes, call it on every process (a collective).
    """
    algorithm = algorithm or algorithm_for(tree)
    if algorithm == ALGORITHM:
        return {n: [c, shape, dtype] for n, (c, _, shape, dtype) in device_digests(tree).items()}
    _check_algorithm(algorithm)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {leaf_name(p): _crc_entry(_host(x))[0] for p, x in flat}


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {ALGORITHMS})")


def _host(leaf) -> np.ndarray:
    """A host copy of one array (gathered to every host if it spans processes: a collective,
    called on every process alike)."""
    if _spans_processes(leaf):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def _crc_entry(host: np.ndarray) -> tuple[list, int]:
    """(`[crc32, shape, dtype]`, count of NaN/Inf) of a host array."""
    bad = 0
    if jnp.issubdtype(host.dtype, jnp.inexact):
        bad = host.size - int(np.count_nonzero(np.isfinite(host)))
    return [array_checksum(host), list(host.shape), str(host.dtype)], bad


def check_arrays(tree, expected: dict | None, *, algorithm: str = CRC32, partial=False):
    """One pass over the arrays of `tree`: `(mismatched, nonfinite)`.

    Args:
      tree: a pytree of arrays (its leaf names as `leaf_name`), any sharding; with several
        processes, call it on every process (it is a collective).
      expected: `{name: [checksum, shape, dtype]}` (`state_checksums`), or None (not checked).
      algorithm: the manifest's algorithm (`ALGORITHMS`).
      partial: `tree` holds only some of `expected`'s arrays (e.g. the params of a state):
        names it lacks are not mismatches.

    Returns:
      `mismatched`: names whose checksum, shape or dtype differ from `expected` (or that one
      side lacks; `null` entries, which older multi-process checkpoints hold, are not checked);
      `nonfinite`: `(name, count, size)` of every float array holding NaN or Inf.

    Raises:
      ValueError: an unknown `algorithm`.
    """
    _check_algorithm(algorithm)
    flat = [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    got, bad = {}, {}
    if algorithm == ALGORITHM or (expected is None and algorithm_for(tree) == ALGORITHM):
        for name, (c, n, shape, dtype) in device_digests(tree).items():
            got[name], bad[name] = [c, shape, dtype], n
    else:  # crc32, on the host
        on_devices = []  # spanning processes, no entry to check: NaN/Inf counted on the devices
        for name, x in flat:
            if _spans_processes(x) and (expected is None or expected.get(name) is None):
                on_devices.append((name, x))
                got[name] = None
            else:
                got[name], bad[name] = _crc_entry(_host(x))
        if on_devices:
            digests = device_digests(dict(on_devices))
            bad.update({name: digests[name][1] for name, _ in on_devices})
    nonfinite = [
        (name, bad[name], int(np.prod(x.shape, dtype=np.int64))) for name, x in flat if bad[name]
    ]
    mismatched = []
    if expected is not None:
        names = set(got) if partial else set(got) | set(expected)
        for name in sorted(names):
            want, have = expected.get(name, "<missing>"), got.get(name, "<missing>")
            if want is None or have is None:  # spans processes, in an older manifest
                continue
            if want != have:
                mismatched.append(name)
    return mismatched, nonfinite


def nonfinite_message(where: str, nonfinite: list) -> str:
    """One line naming the first array holding NaN/Inf, its count, and how many more."""
    name, bad, size = nonfinite[0]
    more = f" (and {len(nonfinite) - 1} more arrays)" if len(nonfinite) > 1 else ""
    return f"{where}: array {name}: {bad} of {size} values are NaN or Inf{more}"
