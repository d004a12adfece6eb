"""The schedule model (`moejax.aot.schedule`) against hand-computed toy schedules, and on a real
deviceless H100 compile of the sharded layer (skipped without the CUDA compiler wheels).

Toy device `HW`: 1e12 bf16 FLOP/s, 1e12 HBM bytes/s, 1e11 link bytes/s, 1 us per kernel launch,
2 us per collective. Toy ops (times on `HW`):

- `A2A`: all-to-all of f32[100000] (4e5 bytes) over 4 devices: 3/4 * 4e5 / 1e11 + 2 us = 5 us;
- `GEMM`: bf16 [100, 1000] x [1000, 50] in a fusion: 2 * 100 * 50 * 1000 = 1e7 FLOPs = 10 us,
  plus launch = 11 us (its 3.1e5 bytes take 0.31 us, under the FLOPs);
- `EW`: an elementwise fusion over f32[250000]: 2e6 bytes = 2 us, plus launch = 3 us.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.aot import schedule as sm

US = 1e-6
HW = sm.Hardware(
    "toy",
    flops_per_s=(("bf16", 1e12), ("f32", 5e11)),
    hbm_bytes_per_s=1e12,
    link_bytes_per_s=1e11,
    launch_s=1 * US,
    collective_latency_s=2 * US,
)

GEMM_COMP = """
%gemm_comp (p0: bf16[100,1000], p1: bf16[1000,50]) -> bf16[100,50] {
  %p0 = bf16[100,1000]{1,0} parameter(0)
  %p1 = bf16[1000,50]{1,0} parameter(1)
  ROOT %dot = bf16[100,50]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, metadata={op_name="dot"}
}
"""
PARAMS = [
    "%x = f32[100000]{0} parameter(0)",
    "%a = bf16[100,1000]{1,0} parameter(1)",
    "%b = bf16[1000,50]{1,0} parameter(2)",
    "%y = f32[250000]{0} parameter(3)",
]
ASYNC = '"collective_backend_config":{"is_sync":false,"is_pipelined":false}'


def a2a_start(name="s", sync=False):
    config = ASYNC.replace("false", "true", 1) if sync else ASYNC
    return (
        f"%{name} = ((f32[100000]{{0}}), f32[100000]{{0}}) all-to-all-start(%x), channel_id=1, "
        f"replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, "
        f'metadata={{op_name="jit(f)/all_to_all"}}, backend_config={{"operation_queue_id":"0",'
        f"{config}}}"
    )


def a2a_done(name="d", start="s"):
    return f"%{name} = f32[100000]{{0}} all-to-all-done(%{start})"


GEMM = (
    '%g = bf16[100,50]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp, backend_config={"'
    'operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}'
)
EW = "%e = f32[250000]{0} fusion(%y), kind=kLoop, calls=%fused_add"


def module(*lines, comps=GEMM_COMP):
    body = "\n".join(f"  {line}" for line in (*PARAMS, *lines))
    return f"HloModule m, num_partitions=4\n{comps}\nENTRY %main () -> f32[] {{\n{body}\n}}\n"


def test_toy_costs():
    ops = {op.name: op for op in sm.parse(module(a2a_start(), GEMM, EW, a2a_done()))}
    assert ops["x"].kind == sm.FREE
    assert ops["s"].kind == sm.START and ops["s"].collective == "all-to-all"
    assert ops["s"].comm_bytes == 4e5 and ops["s"].groups == ((0, 1, 2, 3),)
    assert ops["d"].kind == sm.DONE and ops["d"].start == "s"
    assert sm.op_seconds(ops["s"], HW) == pytest.approx(5 * US)
    assert (ops["g"].flops, ops["g"].dtype, ops["g"].bytes) == (1e7, "bf16", 3.1e5)
    assert sm.op_seconds(ops["g"], HW) == pytest.approx(11 * US)
    assert (ops["e"].flops, ops["e"].bytes) == (0, 2e6)
    assert sm.op_seconds(ops["e"], HW) == pytest.approx(3 * US)


@pytest.mark.parametrize(
    "lines, step, exposed",
    [
        pytest.param([a2a_start(), GEMM, a2a_done()], 11, 0, id="hidden"),
        pytest.param([a2a_start(), a2a_done(), GEMM], 16, 5, id="nothing-between"),
        pytest.param([a2a_start(), EW, a2a_done()], 5, 2, id="partial"),
        pytest.param(
            [
                "%s = f32[100000]{0} all-to-all(%x), replica_groups={{0,1,2,3}}, dimensions={0}",
                GEMM,
            ],
            16,
            5,
            id="synchronous",
        ),
        pytest.param([a2a_start(sync=True), GEMM, a2a_done()], 16, 5, id="is-sync-start"),
    ],
)
def test_exposed_all_to_all(lines, step, exposed):
    est = sm.estimate(module(*lines), HW)
    assert est.step_s == pytest.approx(step * US)
    assert est.exposed("all-to-all") == pytest.approx(exposed * US)
    assert est.exposed_s == pytest.approx(exposed * US)
    assert est.comm("all-to-all") == pytest.approx(5 * US)
    assert est.step_s == pytest.approx(est.compute_s + est.exposed_s)
    (window,) = est.windows
    assert (window.name, window.collective, window.bytes) == ("s", "all-to-all", 4e5)
    assert window.exposed_s == pytest.approx(exposed * US)


def test_two_collectives_queue_on_the_comm_stream():
    # Both issued at 0: the first ends at 5 us, the second waits for it and ends at 10 us. The
    # 3 us kernel leaves 2 us exposed at the first done, then 5 us at the second.
    lines = [a2a_start("s1"), a2a_start("s2"), EW, a2a_done("d1", "s1"), a2a_done("d2", "s2")]
    est = sm.estimate(module(*lines), HW)
    assert est.step_s == pytest.approx(10 * US)
    assert [w.exposed_s / US for w in est.windows] == pytest.approx([2, 5])
    assert est.exposed("all-to-all") == pytest.approx(7 * US)
    assert est.comm_s == pytest.approx(10 * US)


LOOP_COMPS = (
    GEMM_COMP
    + """
%body (t: (s32[])) -> (s32[]) {
  %a = bf16[100,1000]{1,0} parameter(1)
  %b = bf16[1000,50]{1,0} parameter(2)
  %x = f32[100000]{0} parameter(0)
  %s = ((f32[100000]{0}), f32[100000]{0}) all-to-all-start(%x), replica_groups={{0,1,2,3}}
  %g = bf16[100,50]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp
  %d = f32[100000]{0} all-to-all-done(%s)
  ROOT %t = (s32[]) tuple()
}

%cond (t: (s32[])) -> pred[] {
  %t = (s32[]) parameter(0)
  ROOT %c = pred[] constant(true)
}
"""
)


def test_while_with_known_trip_count_repeats_its_body():
    loop = (
        "%w = (s32[]) while(%t0), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}'
    )
    (op,) = [
        o
        for o in sm.parse(module("%t0 = (s32[]) tuple()", loop, comps=LOOP_COMPS))
        if o.kind == sm.LOOP
    ]
    assert op.trip_count == 3 and [o.name for o in op.body if o.kind != sm.FREE] == ["s", "g", "d"]
    est = sm.simulate([op], HW)
    assert est.step_s == pytest.approx(33 * US) and est.compute_s == pytest.approx(33 * US)
    assert est.comm("all-to-all") == pytest.approx(15 * US) and est.exposed_s == 0
    assert [(w.name, w.count) for w in est.windows] == [("s", 3)]
    assert not est.notes


def test_while_without_trip_count_runs_default_and_says_so():
    loop = "%w = (s32[]) while(%t0), condition=%cond, body=%body"
    text = module("%t0 = (s32[]) tuple()", loop, comps=LOOP_COMPS)
    once = sm.estimate(text, HW)
    assert once.step_s == pytest.approx(11 * US) and once.notes == ("w: trip count unknown, ran 1",)
    four = sm.estimate(text, HW, default_trip_count=4)
    assert four.step_s == pytest.approx(44 * US)


def test_loop_shortcut_equals_unrolled_replay():
    # A collective issued before the loop is in flight during the first iteration, so the first
    # iterations are replayed one by one until the state repeats.
    def op(name, kind, **kw):
        return sm.Op(name, name, kind, **kw)

    coll = dict(collective="all-to-all", comm_bytes=4e6, groups=((0, 1, 2, 3),))
    kernel = dict(flops=4e6, dtype="bf16")

    def body(i):
        return [
            op(f"s{i}", sm.START, **coll),
            op(f"k{i}", sm.COMPUTE, **kernel),
            op(f"d{i}", sm.DONE, start=f"s{i}"),
            op(f"k2{i}", sm.COMPUTE, **kernel),
        ]

    before = [op("big", sm.START, **dict(coll, comm_bytes=4e7)), op("k", sm.COMPUTE, **kernel)]
    after = [op("dbig", sm.DONE, start="big")]
    loop = op("w", sm.LOOP, body=tuple(body("")), trip_count=6)
    unrolled = [o for i in range(6) for o in body(i)]
    shortcut = sm.simulate([*before, loop, *after], HW)
    reference = sm.simulate([*before, *unrolled, *after], HW)
    for field in ("step_s", "compute_s", "comm_s", "exposed_s"):
        assert getattr(shortcut, field) == pytest.approx(getattr(reference, field)), field
    assert shortcut.exposed_by_kind == pytest.approx(reference.exposed_by_kind)
    assert sum(w.count for w in shortcut.windows) == len(reference.windows) == 7
    assert sum(w.exposed_s * w.count for w in shortcut.windows) == pytest.approx(
        reference.exposed_s
    )


def test_conditional_takes_the_longest_branch_and_calls_are_inlined():
    comps = (
        GEMM_COMP
        + """
%br0 (p: f32[]) -> f32[] {
  %a = bf16[100,1000]{1,0} parameter(1)
  %b = bf16[1000,50]{1,0} parameter(2)
  ROOT %g = bf16[100,50]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp
}

%br1 (p: f32[]) -> f32[] {
  %y = f32[250000]{0} parameter(0)
  ROOT %e = f32[250000]{0} fusion(%y), kind=kLoop, calls=%fused_add
}
"""
    )
    cond = "%c = f32[] conditional(%p, %x, %x), branch_computations={%br1, %br0}"
    assert sm.estimate(module("%p = s32[] constant(0)", cond, comps=comps), HW).step_s == (
        pytest.approx(11 * US)
    )
    call = "%k = f32[] call(%x), to_apply=%br1"
    (e,) = [o for o in sm.parse(module(call, comps=comps)) if o.kind == sm.COMPUTE]
    assert e.name == "e"


def test_dot_flops_from_cublas_fusions_and_convolutions():
    cublas = (
        '%cc = (bf16[100,50]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cubl'
        'as$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_re'
        'al":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimen'
        'sions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"o'
        'perand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"}}}'
    )
    conv = "%cv = bf16[100,50]{1,0:T(8,128)(2,1)} convolution(%a, %b), dim_labels=bf_io->bf"
    batched = (
        "%bd = f32[4,100,50]{2,1,0} dot(%xa, %xb), lhs_batch_dims={0}, lhs_contracting_dims={2}, "
        "rhs_batch_dims={0}, rhs_contracting_dims={1}, operand_precision={highest,highest}"
    )
    operands = [
        "%xa = f32[4,100,250]{2,1,0} parameter(4)",
        "%xb = f32[4,250,50]{2,1,0} parameter(5)",
    ]
    ops = {o.name: o for o in sm.parse(module(*operands, cublas, conv, batched, GEMM))}
    assert (ops["cc"].flops, ops["cc"].dtype) == (1e7, "bf16")
    assert ops["cc"].bytes == 2e5 + 1e5 + 1e4 + 4194304  # operands, result and workspace
    assert (ops["cv"].flops, ops["cv"].dtype) == (1e7, "bf16")
    assert (ops["bd"].flops, ops["bd"].dtype) == (2 * 4 * 100 * 50 * 250, "f32_highest")
    assert (ops["g"].flops, ops["g"].dtype) == (1e7, "bf16")
    # A rate the hardware does not list runs at its slowest one.
    assert HW.peak("f32_highest") == 5e11


def test_collective_bytes_of_each_kind():
    comps = """
%rs_comp (p: f32[400000]) -> f32[100000] {
  %p = f32[400000]{0} parameter(0)
  ROOT %rs = f32[100000]{0} reduce-scatter(%p), replica_groups=[1,4]<=[4], to_apply=%add
}
"""
    lines = [
        "%big = f32[400000]{0} parameter(4)",
        "%ag = (f32[100000]{0}, f32[400000]{0}) all-gather-start(%x), replica_groups={{0,1,2,3}}",
        "%agd = f32[400000]{0} all-gather-done(%ag)",
        "%rss = ((f32[400000]{0}), f32[100000]{0}) async-start(%big), calls=%rs_comp",
        "%rsd = f32[100000]{0} async-done(%rss)",
        "%ar = f32[100000]{0} all-reduce-start(%x), replica_groups=[2,2]<=[4], to_apply=%add",
        "%ard = f32[100000]{0} all-reduce-done(%ar)",
        "%cp = (f32[100000]{0}, f32[100000]{0}) collective-permute-start(%x), "
        "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
        "%cpd = f32[100000]{0} collective-permute-done(%cp)",
    ]
    ops = {o.name: o for o in sm.parse(module(*lines, comps=comps))}
    got = {
        n: (ops[n].kind, ops[n].collective, ops[n].comm_bytes) for n in ("ag", "rss", "ar", "cp")
    }
    assert got == {
        "ag": (sm.START, "all-gather", 1.6e6),
        "rss": (sm.START, "reduce-scatter", 1.6e6),
        "ar": (sm.START, "all-reduce", 4e5),
        "cp": (sm.START, "collective-permute", 4e5),
    }
    assert ops["rss"].groups == ((0, 1, 2, 3),) and ops["ar"].groups == ((0, 1), (2, 3))
    seconds = {n: sm.op_seconds(ops[n], HW) / US for n in got}
    # (N-1)/N of the gathered / scattered buffer; 2 (N-1)/N for all-reduce; the buffer once.
    assert seconds == pytest.approx({"ag": 14, "rss": 14, "ar": 6, "cp": 6})


def test_iota_replica_groups_with_transpose():
    line = "%ar = f32[100000]{0} all-reduce(%x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    (op,) = [o for o in sm.parse(module(line)) if o.kind == sm.SYNC]
    assert op.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_all_to_all_across_nodes_matches_the_placement_model():
    from moejax.placement import H100_IB

    hw = dataclasses.replace(sm.H100_SXM, collective_latency_s=0.0)
    nbytes = 16e6
    for n in (8, 16, 64):
        got = sm.collective_seconds("all-to-all", nbytes, [tuple(range(n))], hw)
        want = H100_IB.transfer_s(nbytes * (n - 1) / n, n)
        assert got == pytest.approx(float(want))
    assert (sm.H100_SXM.peak("bf16"), sm.H100_SXM.link_bytes_per_s) == (
        H100_IB.flops_per_s,
        H100_IB.node_link_bytes_per_s,
    )
    assert sm.H100_SXM.network_bytes_per_s == H100_IB.link_bytes_per_s


def test_measured_times_replace_the_model():
    est = sm.estimate(module(a2a_start(), GEMM, a2a_done()), HW, measured={"g": 2 * US})
    assert est.step_s == pytest.approx(5 * US) and est.exposed_s == pytest.approx(3 * US)


def test_hardware_is_validated():
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        dataclasses.replace(HW, link_bytes_per_s=0)
    with pytest.raises(ValueError, match="network_bytes_per_s"):
        dataclasses.replace(HW, node_size=8)


def test_summary_and_table():
    est = sm.estimate(module(a2a_start(), EW, a2a_done()), HW)
    assert est.summary() == (
        "toy: step 0.005 ms = compute 0.003 + exposed 0.002 "
        "(comm 0.005; exposed/total by kind: all-to-all 0.002/0.005)"
    )
    assert "| all-to-all | 1 | 0.005 | 0.002 |" in est.table()


# ---------------------------------------------------------------------------------------------
# A real XLA:GPU schedule (deviceless H100 compile).
# ---------------------------------------------------------------------------------------------


def _missing_cuda():
    from pallas_kernels import targets

    return targets.missing("cuda")


@pytest.mark.deviceless
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.skipif(_missing_cuda() is not None, reason=str(_missing_cuda()))
def test_staggered_capacity_layer_exposes_less_all_to_all_on_h100():
    import moejax
    from moejax import aot, parallel

    cfg = moejax.MoEConfig(d_model=512, d_ff=1024, num_experts=8, top_k=2, drop_policy="capacity")
    mesh = aot.mesh("cuda", (8,), ("expert",))
    strategy = parallel.Strategy(dispatcher="capacity", chunks=4)
    _, (params, x) = aot.layer_program(cfg, mesh, strategy, tokens=64 * 256, seq_len=256)
    x = jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)

    def compile_(stagger, options=None):
        def fn(p, x):
            return parallel.moe_apply_sharded(
                p, x, cfg, mesh, strategy=strategy, implementation="ragged_dot", stagger=stagger
            )[0]

        text = aot.compile_program(fn, (params, x), compiler_options=options).text
        return sm.estimate(text, sm.H100_SXM)

    staged, plain = compile_(True), compile_(False)
    sync = compile_(True, {"xla_gpu_disable_async_collectives": "ALLTOALL"})
    for est in (staged, plain, sync):
        # 4 chunks x (counts, rows, return) all-to-alls, all of one size per kind.
        assert sum(w.count for w in est.windows) == 12 and set(est.comm_by_kind) == {"all-to-all"}
    assert staged.comm_s == pytest.approx(plain.comm_s) == pytest.approx(sync.comm_s)
    # Chunk i's expert GEMMs hide chunk i+1's exchanges; unstaggered, nothing runs in a window.
    assert staged.exposed("all-to-all") < 0.5 * plain.exposed("all-to-all")
    assert staged.step_s < plain.step_s
    # Negative control: synchronous all-to-alls are exposed in full.
    assert all(w.synchronous for w in sync.windows)
    assert sync.exposed("all-to-all") == pytest.approx(sync.comm("all-to-all"), rel=1e-9)
    assert np.isclose(sync.step_s, sync.compute_s + sync.comm_s)


def _missing_tpu():
    from pallas_kernels import targets

    return targets.missing("tpu")


@pytest.mark.deviceless
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.skipif(_missing_tpu() is not None, reason=str(_missing_tpu()))
def test_tpu_schedule_matmuls_as_convolutions_and_a_synchronous_all_to_all():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moejax import aot

    mesh = aot.mesh("tpu", (4,), ("x",), generation="v5e")

    def body(a, w):
        return jax.lax.all_to_all(a, "x", 0, 0, tiled=True) + jnp.tanh(a @ w)

    def fn(a, w):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(a, w)

    a = jax.ShapeDtypeStruct((4 * 1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    ops = sm.parse(aot.compile_program(fn, (a, w)).text)
    assert sum(o.flops for o in ops) == 2 * 1024 * 512 * 512
    (a2a,) = [o for o in ops if o.collective]
    # Without --xla_tpu_enable_async_all_to_all, libtpu's all-to-all is synchronous.
    assert (a2a.kind, a2a.comm_bytes, a2a.groups) == (sm.SYNC, 1024 * 512 * 2, ((0, 1, 2, 3),))
    est = sm.simulate(ops, sm.TPU_V5E)
    assert est.exposed("all-to-all") == pytest.approx(est.comm("all-to-all"))
