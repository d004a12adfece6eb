"""Public surface, mesh conventions, partition specs and argument validation (no compilation)."""

import jax
import jax.numpy as jnp
import pytest
from _common import CAPACITY, DROPLESS, SHARED, make_params, mesh
from jax.sharding import PartitionSpec as P

from moejax import parallel
from moejax.parallel import Strategy


def test_public_names_import():
    for name in parallel.__all__:
        assert getattr(parallel, name) is not None, name


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ((8,), None),
        ((2, 4), None),
        ((4, 2), ("expert", "model")),
        ((1, 8), None),
        ((2, 2, 2), None),
        ((8,), ("data",)),
        ((8,), ("model",)),
    ],
)
def test_make_mesh_auto_axes(shape, names):
    m = parallel.make_mesh(shape, names)
    assert tuple(m.shape.values()) == shape
    assert all(str(t).endswith("Auto") for t in m.axis_types)


@pytest.mark.parametrize(
    ("names", "field"),
    [(("data", "data"), "repeated"), (("batch", "expert"), "'batch'"), (("data",), "one name")],
)
def test_make_mesh_errors(names, field):
    with pytest.raises(ValueError, match=field):
        parallel.make_mesh((2, 4), names)


def test_a_mesh_of_more_devices_than_there_are_says_how_to_simulate_them():
    # jax's own error ("Number of devices 8 must be >= the product of mesh_shape (4, 4)") gave
    # no hint; on a CPU the fix is a config line before the first computation.
    with pytest.raises(ValueError) as err:
        parallel.make_mesh((4, 4), ("data", "expert"))
    msg = str(err.value)
    assert msg.startswith("mesh shape (4, 4) needs 16 devices, 8 are available; on a CPU")
    assert "jax.config.update('jax_num_cpu_devices', 16)" in msg
    assert "--xla_force_host_platform_device_count=16" in msg
    with pytest.raises(ValueError, match=r"needs 4 devices, devices= holds 2$"):
        parallel.make_mesh((4,), ("expert",), devices=jax.devices()[:2])


def test_a_batch_that_does_not_divide_over_the_token_shards_is_one_clear_error():
    # Was jax's IndivisibleError from device_put ("... implies that array axis 0 is
    # partitioned 8 times, but the dimension size is 6 ...").
    m = parallel.make_mesh((2, 4), ("data", "expert"))
    want = r"x.shape\[0\]=6: does not divide over the 8 token shards of the mesh \(data=2 x "
    with pytest.raises(ValueError, match=want + r"expert=4\); give a batch that is a multiple"):
        parallel.shard_activations(jnp.ones((6, 16, 32)), m)
    assert parallel.shard_activations(jnp.ones((8, 16, 32)), m).shape == (8, 16, 32)


def test_param_specs_follow_stored_layout():
    specs = parallel.param_partition_specs(DROPLESS, mesh("d2e2m2"))
    assert specs["router"]["kernel"] == P()
    assert specs["experts"]["w_up"] == P("expert", None, "model")
    assert specs["experts"]["w_down"] == P("expert", "model", None)
    assert specs["experts"]["b_up"] == P("expert", "model")
    assert specs["experts"]["b_down"] == P("expert", None)
    shared = parallel.param_partition_specs(SHARED, mesh("e4m2"))["shared"]
    assert shared["w_up"] == P(None, "model") and shared["gate"] == P(None, None)
    # Axes the mesh lacks are simply not used.
    assert parallel.param_partition_specs(DROPLESS, mesh("d8"))["experts"]["w_up"] == P(
        None, None, None
    )
    assert parallel.activation_spec(mesh("d2e2m2"), 3) == P(("data", "expert"), None, None)
    assert parallel.activation_spec(mesh("m8"), 2) == P(None, None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "pipeline"}, "Strategy.mode"),
        ({"dispatcher": "ragged"}, "Strategy.dispatcher"),
        ({"chunks": 3}, "Strategy.chunks"),
        ({"bucket": 0}, "Strategy.bucket"),
    ],
)
def test_strategy_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Strategy(**kwargs)


def test_call_validation():
    """Mesh and strategy mistakes (the params and x checks shared with `moe_apply` are in
    tests/core/test_input_validation.py)."""
    m = mesh("d2e4")
    params = make_params(DROPLESS)
    x3 = jnp.ones((8, 8, 16))
    with pytest.raises(ValueError, match="drop_policy='capacity'"):
        parallel.moe_apply_sharded(
            params, x3, DROPLESS, m, strategy=Strategy(dispatcher="capacity")
        )
    with pytest.raises(ValueError, match="sequence axis"):
        parallel.moe_apply_sharded(make_params(CAPACITY), jnp.ones((64, 16)), CAPACITY, m)
    with pytest.raises(ValueError, match=r"x.shape\[0\]=6"):
        parallel.moe_apply_sharded(params, jnp.ones((6, 8, 16)), DROPLESS, m)
    with pytest.raises(ValueError, match="strategy='fast'"):
        parallel.moe_apply_sharded(params, x3, DROPLESS, m, strategy="fast")
    with pytest.raises(ValueError, match="num_experts=6: not divisible by expert=4"):
        parallel.param_partition_specs(DROPLESS.replace(num_experts=6, top_k=2), mesh("e4m2"))


def test_cost_model_orders_modes():
    s = parallel.traffic.LayerShape(
        tokens=1024, top_k=2, d_model=512, d_ff=1024, num_experts=8, n=8
    )
    worst = parallel.traffic.buffer_bytes(s, "worst")
    cap1 = parallel.traffic.buffer_bytes(s, "capacity", capacity_factor=1.0)
    assert worst == 8 * cap1  # N T K D vs E (T K / E) D
    assert parallel.traffic.buffer_bytes(s, "dropless", bucket=256) == cap1
    assert parallel.traffic.comm_bytes(s, "expert", "dropless", bucket=256) == pytest.approx(
        parallel.traffic.comm_bytes(s, "expert", "capacity"), rel=0.15
    )
