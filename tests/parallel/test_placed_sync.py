"""Replica gradient sync is proportional to replication (`slots.combine_replica_grads`).

Numerics: on the 8 simulated devices with the real sharding, every slot gets the sum of its
expert's replica gradients (a float64 numpy reference: the former `segment_sum` over all `P`
slots), replicas bit-identical, unreplicated slots untouched.

Collectives, read from the compiled program: the replica sync is an all-reduce over the `expert`
axis only; none when `P == E` (no spare slot); with `X = P - E` spare slots one branch per buffer
size of `sync_buffer_sizes` (1, 2, ..., X expert gradients), and a placement runs the smallest
branch holding its experts spread over several devices (as `cost_model.packed_sync_gradients`
charges).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import DROPLESS, make_params, mesh
from jax.sharding import NamedSharding, PartitionSpec

from moejax.parallel import mesh as mesh_lib
from moejax.parallel import slots
from moejax.placement import Placement
from moejax.placement.cost_model import packed_sync_gradients

E = 8


def _table(rows):
    """A placement from per-device slot lists (`[N][S]` experts)."""
    rows = np.asarray(rows)
    return Placement(rows.reshape(-1), E, rows.shape[0], rows.shape[1])


def _random(n, s, seed):
    rng = np.random.default_rng(seed)
    table = np.concatenate([np.arange(E), rng.integers(0, E, n * s - E)])
    rng.shuffle(table)
    return Placement(table, E, n, s)


# name -> (placement for N = 4, experts spread over several devices)
PLACEMENTS = {
    "no_spare_slot": (Placement.identity(E, 4, 2), 0),
    "local_duplicates": (Placement.identity(E, 4, 3), 0),
    "all_spares_to_one_expert": (_table([[0, 1, 5], [2, 3, 5], [4, 5, 5], [6, 7, 5]]), 1),
    "every_spare_another_expert": (_table([[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 0]]), 4),
    "two_spares_one_device": (_table([[0, 1, 7, 7], [2, 3, 1, 1], [4, 5, 0, 6], [6, 7, 5, 5]]), 5),
    "random": (_random(4, 4, 0), None),
}


def _reference(grads, placement):
    """float64: each slot gets the sum over all slots of its expert."""
    t = placement.slot_to_expert

    def one(g):
        g = np.asarray(g, np.float64)
        per_expert = np.zeros((E,) + g.shape[1:])
        np.add.at(per_expert, t, g)
        return per_expert[t]

    return jax.tree.map(one, grads)


@functools.cache
def _expert_shapes():
    return {name: w.shape[1:] for name, w in make_params(DROPLESS)["experts"].items()}


def _grads(placement, seed=0):
    """Random `[P, ...]` fp32 gradients shaped like DROPLESS's experts (biases included)."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal((placement.num_slots, *shape)).astype(np.float32)
        for name, shape in sorted(_expert_shapes().items())
    }


@functools.cache
def _combine(mesh_name):
    m = mesh(mesh_name)
    specs = mesh_lib.param_partition_specs(DROPLESS, m)["experts"]  # F over model on e4m2
    return jax.jit(lambda g, t: slots.combine_replica_grads(g, t, m, specs)), specs


@pytest.mark.parametrize("mesh_name", ["d2e4", "e4m2"])
def test_combine_sums_every_experts_replicas(mesh_name):
    combine, specs = _combine(mesh_name)
    for name, (placement, spread) in PLACEMENTS.items():
        grads = _grads(placement)
        shard = lambda g, s: jax.device_put(g, NamedSharding(mesh(mesh_name), s))
        table = slots.slot_table(placement)
        out = jax.tree.map(np.asarray, combine(jax.tree.map(shard, grads, specs), table))
        want = _reference(grads, placement)
        for key in grads:
            msg = f"{name} {key}"
            np.testing.assert_allclose(out[key], want[key], rtol=1e-6, atol=1e-6, err_msg=msg)
            assert out[key].dtype == np.float32
            for e in range(E):
                held = placement.replicas_of(e)
                for s in held[1:]:  # replicas stay identical bit for bit
                    np.testing.assert_array_equal(out[key][s], out[key][held[0]], err_msg=msg)
                if len(held) == 1:  # an unreplicated expert's gradient is not touched
                    np.testing.assert_array_equal(out[key][held[0]], grads[key][held[0]])
        rank, count = slots.sync_ranks(table, 4)
        holders = [len(set(placement.device_of_slot(placement.replicas_of(e)))) for e in range(E)]
        spans = np.array(holders) >= 2
        assert int(count) == spans.sum() == (spans.sum() if spread is None else spread), name
        np.testing.assert_array_equal(np.asarray(rank), np.where(spans, np.cumsum(spans) - 1, E))


def test_combine_on_one_device_and_eight_expert_devices():
    # All 8 spare slots of e8 to other experts (X = E = 8: the largest buffer), and no mesh.
    placement = _table([[d, (d + 3) % E] for d in range(E)])
    grads = _grads(placement, seed=1)
    table = slots.slot_table(placement)
    m = mesh("e8")
    sharded = jax.device_put(grads, NamedSharding(m, PartitionSpec("expert")))
    for got in (
        jax.jit(lambda g, t: slots.combine_replica_grads(g, t, m))(sharded, table),
        jax.jit(slots.combine_replica_grads)(grads, table),
    ):
        want = _reference(grads, placement)
        for key in grads:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)
    assert packed_sync_gradients(placement) == 8


def test_buffer_sizes_and_the_cost_models_rule_agree():
    assert slots.sync_buffer_sizes(8, 8) == (0,)
    assert slots.sync_buffer_sizes(10, 8) == (0, 1, 2)
    assert slots.sync_buffer_sizes(12, 8) == (0, 1, 2, 4)
    assert slots.sync_buffer_sizes(14, 8) == (0, 1, 2, 4, 6)
    assert slots.sync_buffer_sizes(40, 8) == (0, 1, 2, 4, 8)  # at most E experts to sync
    for n, s in ((2, 5), (4, 3), (4, 4), (8, 2), (8, 3)):
        sizes = slots.sync_buffer_sizes(n * s, E)
        for seed in range(20):
            p = _random(n, s, seed)
            _, m = slots.sync_ranks(slots.slot_table(p), n)
            want = min(b for b in sizes if b >= int(m))
            assert packed_sync_gradients(p) == want, (n, s, seed)


# ---- compiled collectives ----------------------------------------------------------------------

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) "
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_BITS = {"f32": 32, "bf16": 16, "f16": 16, "s32": 32, "u32": 32, "pred": 8, "f64": 64, "s64": 64}


def _iota(spec: str) -> np.ndarray:
    """Device ids of an iota tile `[dims]` or `[dims]T(perm)`."""
    hit = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if not hit:
        raise ValueError(f"device ids not understood: {spec!r}")
    dims = tuple(int(d) for d in hit[1].split(","))
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(tuple(int(a) for a in hit[2].split(","))) if hit[2] else ids


def _groups(line: str) -> str:
    """A collective's replica groups as `{{0,1},{2,3}}` from the forms XLA prints: explicit,
    iota (`[G,S]<=[dims]T(perm)`) or mesh axes (`mesh['a'=2,...], device_ids=(...) {'a'}`);
    another form raises (so no collective is skipped unseen)."""
    explicit = re.search(r"replica_groups=(\{[\d,{}]*\})", line)
    if explicit:
        return explicit.group(1)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line)
    mesh_form = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^ ]*)\))? \{([^}]*)\}", line
    )
    if iota:
        rows = _iota(iota[3]).reshape(int(iota[1]), int(iota[2]))
    elif mesh_form:
        axes = [(a.split("=")[0].strip("'"), int(a.split("=")[1])) for a in mesh_form[1].split(",")]
        names, sizes = [a for a, _ in axes], [n for _, n in axes]
        ids = (_iota(mesh_form[2]) if mesh_form[2] else np.arange(np.prod(sizes))).reshape(sizes)
        over = [names.index(a.strip().strip("'")) for a in mesh_form[3].split(",")]
        rest = [i for i in range(len(names)) if i not in over]
        rows = ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[i] for i in over])))
    else:
        raise ValueError(f"replica groups not understood: {line.strip()[:200]}")
    rows = sorted(sorted(r) for r in rows.tolist())
    return "{" + ",".join("{" + ",".join(map(str, r)) + "}" for r in rows) + "}"


def collectives(hlo_text: str) -> list[tuple[str, str, str, tuple, int]]:
    """`(computation, op, replica groups, shapes, bytes)` of every collective in compiled HLO."""
    out, comp = [], ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if header and line.rstrip().endswith("{"):
            comp = header.group(1)
        hit = _COLLECTIVE.match(line)
        if hit:
            arrays = [
                (a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
                for a in _ARRAY.finditer(hit["shape"])
            ]
            nbytes = sum(_BITS[t] // 8 * int(np.prod(dims)) for t, dims in arrays)
            shapes = tuple(d for _, d in arrays)
            out.append((comp, hit["op"], _groups(line), shapes, nbytes))
    return out


def test_replica_groups_in_every_form_xla_prints():
    assert _groups("x, replica_groups={{0,1},{2,3}}, y") == "{{0,1},{2,3}}"
    assert _groups("x, replica_groups=[2,2]<=[2,2]T(1,0), y") == "{{0,2},{1,3}}"
    line = "x, replica_groups=mesh['a'=2,'b'=1,'c'=4], device_ids=([4,2]T(1,0)) {'a'}, y"
    assert _groups(line) == "{{0,1},{2,3},{4,5},{6,7}}"
    assert _groups("x, replica_groups=mesh['a'=2,'b'=2] {'b'}, y") == "{{0,1},{2,3}}"
    with pytest.raises(ValueError, match="not understood"):
        _groups("x, replica_groups=?, y")


def _expert_groups(m) -> str:
    """The replica groups of a collective over the `expert` axis alone, as HLO prints them."""
    ids = np.vectorize(lambda d: d.id)(m.devices)
    axis = m.axis_names.index("expert")
    rows = np.moveaxis(ids, axis, -1).reshape(-1, ids.shape[axis])
    return "{" + ",".join("{" + ",".join(map(str, sorted(r))) + "}" for r in rows) + "}"


def sync_bytes_per_branch(hlo_text: str, m) -> list[int]:
    """Bytes all-reduced over the `expert` axis, per computation holding such all-reduces
    (a branch of the sync's `switch`), sorted."""
    per_comp: dict[str, int] = {}
    for comp, op, groups, _, nbytes in collectives(hlo_text):
        if groups == _expert_groups(m):
            assert op == "all-reduce", (op, comp)
            per_comp[comp] = per_comp.get(comp, 0) + nbytes
    return sorted(per_comp.values())


@pytest.fixture(scope="module")
def lm():
    from moejax.models import presets

    return presets.get("micro")


def _segment_sum_combine(grads, tables, lm):
    """The former combine (a `segment_sum` over all `P` slots, split over `expert`)."""
    from moejax.training import placed as train_placed

    def layer(j, experts):
        t = tables[j]
        one = lambda g: jnp.take(
            jax.ops.segment_sum(g, t.slot_to_expert, t.num_experts), t.slot_to_expert, axis=0
        )
        return jax.tree.map(one, experts)

    return train_placed.map_experts(grads, lm, layer)


def _compiled_combine(lm, per_device: int, m, combine=None) -> str:
    """The training step's `combine_grads` (its stored specs), compiled for `per_device` slots
    per device (or `combine(grads, tables, lm)` on the same sharded inputs)."""
    from moejax.models import lm_partition_specs
    from moejax.training import placed as train_placed
    from moejax.training import presets as train_presets
    from moejax.training.state import abstract_state

    cfg = train_presets.get("micro").replace(expert_slots_per_device=per_device)
    n = dict(m.shape)["expert"]
    placements = train_placed.initial_placements(lm, cfg, m)
    p = placements[0].num_slots
    specs = lm_partition_specs(lm, m)
    abstract = abstract_state(lm, cfg).params

    def physical(path_leaf, spec):
        path, leaf = path_leaf
        shape = leaf.shape
        if any(getattr(k, "key", None) == "experts" for k in path):
            shape = (p,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(m, spec))

    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    grads = jax.tree.unflatten(
        tree, [physical(pl, s) for pl, s in zip(flat, spec_leaves, strict=True)]
    )
    tables = train_placed.slot_tables(placements)
    shardings = jax.tree.map(lambda g: g.sharding, grads)
    if combine is None:
        combine = lambda g, t, lm: train_placed.combine_grads(g, t, lm, m)
    fn = jax.jit(lambda g, t: combine(g, t, lm), out_shardings=shardings)
    assert p == n * per_device
    return fn.lower(grads, tables).compile().as_text()


def test_compiled_sync_bytes_follow_the_spare_slots(lm):
    # micro: E = 8 on a (data 4, expert 2) mesh, two MoE layers; expert gradients w_gate, w_up
    # [P, 32, 32] and w_down (no biases): one expert's gradient is 3 * 32 * 32 fp32.
    m = mesh_lib.make_mesh((4, 2), ("data", "expert"))
    grad = 3 * 32 * 32 * 4
    assert collectives(_compiled_combine(lm, 4, m)) == []  # P == E: no collective at all
    # The former segment_sum all-reduced every expert's gradient of both layers, P == E or not.
    former = collectives(_compiled_combine(lm, 4, m, _segment_sum_combine))
    assert {c[2] for c in former} == {_expert_groups(m)}
    assert sum(c[-1] for c in former) == 2 * 8 * grad
    two = sync_bytes_per_branch(_compiled_combine(lm, 5, m), m)  # X = 2: buffers of 1, 2
    four = sync_bytes_per_branch(_compiled_combine(lm, 6, m), m)  # X = 4: 1, 2, 4
    per_layer = lambda sizes: sorted(b * grad for b in sizes for _ in range(2))  # 2 MoE layers
    assert two == per_layer((1, 2))
    assert four == per_layer((1, 2, 4))
    assert max(four) == 2 * max(two)  # the largest buffer grows with the spare slots


@pytest.mark.slow
def test_compiled_train_step_has_no_expert_axis_collective_without_spare_slots(lm):
    # The whole placed train step (~25 s each to compile on 2 cores): with P == E nothing but the
    # MoE dispatch crosses the expert axis; with 4 spare slots only the sync's all-reduces join.
    from moejax.training import init_train_state, make_train_step
    from moejax.training import placed as train_placed
    from moejax.training import presets as train_presets
    from moejax.training.state import batch_sharding

    m = mesh_lib.make_mesh((4, 2), ("data", "expert"))
    grad = 3 * 32 * 32 * 4
    found = {}
    for per_device in (4, 6):
        cfg = train_presets.get("micro").replace(expert_slots_per_device=per_device)
        ps = train_placed.initial_placements(lm, cfg, m)
        state = train_placed.to_physical(init_train_state(lm, cfg, m), ps, lm, cfg, m)
        batch = jax.ShapeDtypeStruct(
            (cfg.batch_size, lm.max_seq_len + 1), jnp.int32, sharding=batch_sharding(m)
        )
        step = make_train_step(lm, cfg, m)
        text = step.lower(state, batch, train_placed.slot_tables(ps)).compile().as_text()
        found[per_device] = [
            (op, shapes, nbytes)
            for _, op, groups, shapes, nbytes in collectives(text)
            if groups == _expert_groups(m) and op == "all-reduce"
        ]
    assert not [c for c in found[4] if any(s[-2:] == (32, 32) for s in c[1])]
    sync = [c for c in found[6] if any(s[-2:] == (32, 32) for s in c[1])]
    assert sorted({c[2] for c in sync}) == [grad, 2 * grad, 4 * grad]
