"""Issue 50: the device checksum (`moejax.training.checksums`, "fmixsum64") is one number per
array whatever its sharding, and changes when any element does; one rule picks it or CRC-32,
and CRC-32 manifests are verified however the arrays are sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import MODEL, TRAIN, mesh
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from moejax import parallel
from moejax.training import init_train_state
from moejax.training.checksums import (
    ALGORITHM,
    algorithm_for,
    array_checksum,
    check_arrays,
    device_digests,
    state_checksums,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_)


def _sums(tree):
    return state_checksums(tree, ALGORITHM)


def _array(dtype, shape=(8, 12, 16)):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 50
    return (x > 0) if dtype == jnp.bool_ else x.astype(dtype)


def _on(x, shape, spec):
    return jax.device_put(x, NamedSharding(parallel.make_mesh(shape, ("data", "expert")), spec))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_the_checksum_is_the_same_on_one_device_and_on_meshes(dtype):
    x = _array(dtype)
    one = jax.device_put(x, SingleDeviceSharding(jax.devices()[3]))
    layouts = [
        _on(x, (1, 8), PartitionSpec("expert")),  # [8] over 8 devices
        _on(x, (2, 4), PartitionSpec("expert", None, "data")),
        _on(x, (2, 4), PartitionSpec(None, "expert", None)),  # replicated over data
        _on(x, (4, 2), PartitionSpec(("data", "expert"))),
        _on(x, (2, 4), PartitionSpec()),  # replicated everywhere
        np.asarray(x),  # a host array
    ]
    want = _sums({"x": one})["x"]
    assert want[1:] == [[8, 12, 16], jnp.dtype(dtype).name]
    for y in layouts:
        assert _sums({"x": y})["x"] == want


def test_a_train_state_has_one_checksum_on_the_mesh_and_on_one_device():
    state = init_train_state(MODEL, TRAIN, mesh())
    host = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), state)
    sharded = _sums(state.__dict__)
    assert sharded == _sums(host.__dict__)
    assert len(sharded) > 10 and all(isinstance(v[0], int) for v in sharded.values())


def _changes(x):
    """Versions of `x` that differ from it in one element or in a few."""
    flat = np.asarray(x).reshape(-1).copy()

    def at(*edits):
        y = flat.copy()
        for i, value in edits:
            y[i] = value
        return jnp.asarray(y.reshape(x.shape))

    if flat.dtype == np.bool_:
        return [at((0, ~flat[0])), at((100, ~flat[100]), (101, ~flat[101])),
                at((-1, ~flat[-1]))]  # fmt: skip
    bits = flat.view(f"u{flat.dtype.itemsize}")
    low, top = bits.dtype.type(1), bits.dtype.type(1 << (8 * flat.dtype.itemsize - 1))

    def flip(i, mask):  # element i with the bits of `mask` flipped
        return i, np.array(bits[i] ^ mask).view(flat.dtype)

    i, j = next((i, i + 1) for i in range(5, len(flat)) if flat[i] != flat[i + 1])
    return [
        at(flip(0, low)),  # the lowest bit of the first element
        at(flip(len(flat) - 1, top)),  # the sign bit of the last
        at(flip(7, top), flip(900, top)),  # two sign bits (cancel in a plain weighted sum)
        at((i, flat[j]), (j, flat[i])),  # two elements swapped
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_the_checksum_changes_when_any_element_changes(dtype):
    x = _on(_array(dtype), (2, 4), PartitionSpec("data", "expert"))
    want = _sums({"x": x})
    for y in _changes(x):
        assert not np.array_equal(np.asarray(y), np.asarray(x))
        y = jax.device_put(y, x.sharding)
        assert _sums({"x": y})["x"][0] != want["x"][0]
        assert check_arrays({"x": y}, want, algorithm=ALGORITHM) == (["x"], [])


def test_nonfinite_values_are_counted_on_the_devices():
    x = _on(jnp.zeros((8, 16)).at[1, 2].set(jnp.nan).at[7, 15].set(-jnp.inf), (2, 4),
            PartitionSpec("expert", "data"))  # fmt: skip
    tree = {"w": x, "n": jnp.arange(4)}
    assert check_arrays(tree, None) == ([], [("w", 2, 128)])  # (on the host: crc32)
    assert check_arrays(tree, _sums(tree), algorithm=ALGORITHM) == ([], [("w", 2, 128)])
    assert {k: v[1] for k, v in device_digests(tree).items()} == {"w": 2, "n": 0}


def test_one_process_writes_crc32_and_verifies_it_on_any_mesh():
    state = init_train_state(MODEL, TRAIN, mesh())
    tree = {"params": state.params, "step": state.step}
    assert algorithm_for(tree) == "crc32"  # this process holds every array whole
    sums = state_checksums(tree)
    name = "params.layers[1].moe.experts.w_up"
    w = tree["params"]["layers"][1]["moe"]["experts"]["w_up"]
    assert sums[name] == [array_checksum(np.asarray(w)), list(w.shape), "float32"]
    assert check_arrays(tree, sums) == ([], [])
    on_one = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[5]), tree)
    assert check_arrays(on_one, sums) == ([], [])
    tree["params"]["layers"][1]["moe"]["experts"]["w_up"] = w.at[3, 5, 7].set(-1.9e30)
    assert check_arrays(tree, sums) == ([name], [])
    assert check_arrays(tree, {**sums, name: None}) == ([], [])  # null entries: not checked
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        check_arrays(tree, sums, algorithm="md5")
    assert ALGORITHM == "fmixsum64"


def test_arrays_on_meshes_of_one_device_set_in_other_orders():
    x, y = _array(jnp.float32), _array(jnp.int32)
    devices = np.array(jax.devices())
    backwards = jax.sharding.Mesh(devices[::-1].reshape(2, 4), ("data", "expert"))
    tree = {"x": _on(x, (2, 4), PartitionSpec("expert")),
            "y": jax.device_put(y, NamedSharding(backwards, PartitionSpec("expert")))}  # fmt: skip
    assert _sums(tree) == _sums({"x": np.asarray(x), "y": np.asarray(y)})
