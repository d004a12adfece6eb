"""A placed layer (physical expert slots with replicas) computes the single-device layer: outputs,
aux and gradients (replica gradients combined per expert), for every dispatcher that supports a
placement; replica choice splits rows evenly; migration moves exactly the named state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import DROPLESS, inputs, make_params, mesh, single_device

import moejax
from moejax import parallel
from moejax.parallel import Strategy, slots
from moejax.placement import Placement, migration_sources
from moejax.testing import assert_close, force_routing

# 8 experts over 4 expert devices with 3 slots each (P = 12): expert 5 holds 3 replicas on three
# devices, expert 0 two (one a local duplicate), the rest one.
PLACEMENT = Placement(np.array([0, 5, 0, 1, 2, 5, 3, 4, 5, 6, 7, 1]), 8, 4, 3)
STRATEGIES = [
    Strategy(dispatcher="dropless", bucket=3),
    Strategy(dispatcher="dropless", chunks=2),
    Strategy(dispatcher="allgather"),
    Strategy(mode="data"),
    Strategy(mode="tensor", chunks=2),
]


def _loss(y, aux):
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * w) + 0.1 * aux.load_balance_loss + 0.01 * aux.z_loss


def _placed_step(cfg, mesh_name, strategy):
    m = mesh(mesh_name)

    def f(params, x, table):
        y, aux = parallel.moe_apply_sharded(
            params, x, cfg, m, strategy=strategy, implementation="ragged_dot", slot_table=table
        )
        return _loss(y, aux), (y, aux)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _check(cfg, params, x, mesh_name, strategy, placement):
    table = slots.slot_table(placement)
    physical = {**params, "experts": slots.to_physical(params["experts"], table)}
    (_, (y0, aux0)), (g0, gx0) = single_device(cfg, "ragged_dot")(params, x)
    (_, (y, aux)), (g, gx) = _placed_step(cfg, mesh_name, strategy)(physical, x, table)
    assert_close(y, y0, err_msg="y")
    assert_close(aux, aux0, err_msg="aux")
    assert_close(gx, gx0, err_msg="dx")
    assert_close(g["router"], g0["router"], err_msg="router grad")
    combined = slots.combine_replica_grads(g["experts"], table)
    assert_close(combined, slots.to_physical(g0["experts"], table), err_msg="expert grads")
    return aux0


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_placed_layer_matches_single_device(strategy):
    mesh_name = "e4m2" if strategy.mode == "tensor" else "d2e4"
    _check(DROPLESS, make_params(DROPLESS), inputs(), mesh_name, strategy, PLACEMENT)


def test_all_tokens_on_a_replicated_expert_are_delivered():
    params = force_routing(make_params(DROPLESS), expert=5)
    x = jnp.abs(inputs())
    aux = _check(DROPLESS, params, x, "d2e4", Strategy(dispatcher="dropless", bucket=4), PLACEMENT)
    assert int(aux.expert_counts[5]) == x.shape[0] * x.shape[1]
    assert float(aux.dropped_fraction) == 0.0


def test_identity_placement_with_spare_slots_matches():
    identity = Placement.identity(8, 4, 3)  # spare slot = a local duplicate of a home expert
    _check(DROPLESS, make_params(DROPLESS), inputs(), "d2e4", Strategy(), identity)


def test_assign_slots_splits_each_expert_evenly_over_its_replicas():
    table = slots.slot_table(PLACEMENT)
    rng = np.random.default_rng(0)
    index = jnp.asarray(
        rng.choice(8, size=(200, 2), p=[0.1, 0.05, 0.05, 0.05, 0.05, 0.6, 0.05, 0.05]), jnp.int32
    )
    kept = jnp.asarray(rng.random((200, 2)) < 0.9)
    for shard in range(3):
        assigned = np.asarray(slots.assign_slots(index, kept, table, shard))
        index_np, kept_np = np.asarray(index), np.asarray(kept)
        # Every kept assignment lands on a replica of its own expert.
        np.testing.assert_array_equal(
            PLACEMENT.slot_to_expert[assigned][kept_np], index_np[kept_np]
        )
        for e in range(8):
            per_replica = [int(np.sum((assigned == p) & kept_np)) for p in PLACEMENT.replicas_of(e)]
            assert sum(per_replica) == int(np.sum((index_np == e) & kept_np))
            assert max(per_replica) - min(per_replica) <= 1, (e, per_replica)


def test_migration_moves_state_to_the_new_placement():
    cfg = DROPLESS
    experts = make_params(cfg)["experts"]
    new = Placement(np.array([5, 5, 0, 1, 2, 6, 3, 4, 5, 0, 7, 1]), 8, 4, 3)
    old_t, new_t = slots.slot_table(PLACEMENT), slots.slot_table(new)
    sources = migration_sources(PLACEMENT, new)
    moved = slots.migrate(slots.to_physical(experts, old_t), jnp.asarray(sources))
    jax.tree.map(np.testing.assert_array_equal, moved, slots.to_physical(experts, new_t))
    jax.tree.map(np.testing.assert_array_equal, slots.to_logical(moved, new_t), experts)
    # Slot 0 now holds expert 5, which device 0 held in slot 1 (a local copy); slot 2 keeps its
    # expert 0 (no move); slot 5 gets expert 6 from device 3 (a transfer).
    assert sources[0] == 1 and sources[2] == 2 and sources[5] == 9


def test_capacity_dispatcher_with_placement_raises():
    cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=8, drop_policy="capacity")
    params = make_params(cfg)
    table = slots.slot_table(PLACEMENT)
    physical = {**params, "experts": slots.to_physical(params["experts"], table)}
    with pytest.raises(ValueError, match="dispatcher='capacity' with a placement"):
        parallel.moe_apply_sharded(
            physical,
            inputs(),
            cfg,
            mesh("d2e4"),
            strategy=Strategy(dispatcher="capacity"),
            slot_table=table,
        )
