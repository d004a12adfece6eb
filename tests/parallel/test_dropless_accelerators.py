"""The dropless dispatcher compiled for 8 x H100 and a TPU v5e slice on this CPU machine.

Needs the compiler wheels (`python -m pallas_kernels.targets --install`); skips otherwise. On
GPU and TPU the exchange is `ragged-all-to-all` (the compile target picks it; XLA:CPU, which
the other tests run on, gets the padded all-to-all). Round 0 is straight-line code, so with
staged pipelining XLA:GPU puts one chunk's expert GEMMs inside the next chunk's exchange
windows; before round 0 was peeled out of the rounds' `while_loop`, no GEMM sat in any window.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import moejax
from moejax import aot, parallel
from moejax.aot import hlo, windows
from pallas_kernels import targets

pytestmark = [
    pytest.mark.deviceless,
    # A deviceless executable cannot be loaded back from the persistent compilation cache the
    # training tests enable in this worker; jax warns and compiles anyway.
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
]
needs_cuda = pytest.mark.skipif(
    targets.missing("cuda") is not None, reason=str(targets.missing("cuda"))
)
needs_tpu = pytest.mark.skipif(
    targets.missing("tpu") is not None, reason=str(targets.missing("tpu"))
)

CONFIG = moejax.MoEConfig(d_model=512, d_ff=1024, num_experts=8, top_k=2)


@functools.cache
def _compiled(platform: str, chunks: int, stagger: bool, grad: bool) -> str:
    """Compiled text of the layer (forward, or forward and backward) on 8 devices of `platform`,
    64 sequences of 256 tokens, bounded dropless with the ragged exchange."""
    mesh = aot.mesh(platform, (8,), ("expert",))
    strategy = parallel.Strategy(
        dispatcher="dropless", chunks=chunks, stagger=stagger, exchange="ragged"
    )

    def forward(p, x):
        y, _ = parallel.moe_apply_sharded(
            p, x, CONFIG, mesh, strategy=strategy, implementation="ragged_dot"
        )
        return y

    def step(p, x):
        return jax.grad(lambda p, x: jnp.sum(forward(p, x) ** 2), argnums=(0, 1))(p, x)

    _, (params, x) = aot.layer_program(CONFIG, mesh, strategy, tokens=64 * 256, seq_len=256)
    x = jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)
    return aot.compile_program(step if grad else forward, (params, x)).text


def _windows(text: str) -> list[int]:
    """GEMMs inside each async exchange window (ragged rows and the sizes' all-to-all)."""
    pairs = windows.overlap(text, "ragged-all-to-all") + windows.overlap(text, "all-to-all")
    return [n for _, n in pairs]


@needs_cuda
def test_h100_exchanges_rows_with_ragged_all_to_all():
    text = _compiled("cuda", 1, False, True)
    ragged = windows.overlap(text, "ragged-all-to-all")
    # Round 0 in the ENTRY computation, async: send and return in the forward, their
    # transposes (return and send) in the backward.
    assert len(ragged) == 4, ragged
    # The only all-to-all is the sizes' exchange (ints); rows never travel padded. (Async, or
    # synchronous where nothing overlaps it: jax >= 0.11 turns such a pair back into one op.)
    a2a = re.compile(r" all-to-all(?:-start)?\(")
    ops = [line for line in text.splitlines() if a2a.search(line)]
    assert ops and all(not re.search(r"(f32|bf16)\[", a2a.split(op)[0]) for op in ops)
    # The leftover rounds (none in the steady state) stay in their loops, forward and backward.
    assert text.count(" while(") == 2


@needs_cuda
def test_h100_steady_state_runs_nothing_for_the_leftover_rounds():
    """fp8 experts on the Pallas kernels, bf16: of what the leftover loops compute, only the
    loops and the layout copies of the expert weights their kernels read are in the ENTRY
    computation (no weight quantization or other work hoisted out of them)."""
    config = CONFIG.replace(expert_precision="fp8")
    mesh = aot.mesh("cuda", (8,), ("expert",))
    strategy = parallel.Strategy(dispatcher="dropless", exchange="ragged")

    def step(p, x):
        def loss(p, x):
            y, _ = parallel.moe_apply_sharded(
                p, x, config, mesh, strategy=strategy, implementation="pallas"
            )
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(p, x)

    _, args = aot.layer_program(config, mesh, strategy, tokens=64 * 256, seq_len=256)
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=a.sharding), args
    )
    text = aot.compile_program(step, args).text
    entry = hlo.entry(text)
    in_loops = [i for i in entry if "while" in hlo.op_name(i.line).split("/")]
    assert [i.opcode for i in in_loops].count("while") == 2, [i.line for i in in_loops][:3]
    local = (config.num_experts // 8, config.d_model, config.d_ff)
    weight_shapes = {f"[{a},{b},{c}]" for a, b, c in (local, (local[0], *local[:0:-1]))}

    def weight_copy(line):  # `%..transpose.. = bf16[G,D,F]...` or `[G,F,D]`
        name, value = line.split("=", 1)
        return "transpose" in name and any(f"bf16{s}" in value for s in weight_shapes)

    hoisted = [i.line for i in in_loops if i.opcode not in ("while", "get-tuple-element")
               and not weight_copy(i.line)]  # fmt: skip
    assert not hoisted, hoisted[:3]


@needs_cuda
def test_h100_staged_dropless_puts_gemms_inside_exchange_windows():
    staged = _windows(_compiled("cuda", 4, True, False))
    plain = _windows(_compiled("cuda", 4, False, False))
    assert len(staged) == len(plain) == 12  # 4 chunks x (sizes, rows, return)
    # Staged: chunk i's expert GEMMs run inside chunk i+1's exchange windows.
    assert sum(staged) >= 3, staged
    # Negative control: the unstaggered split gets no forward GEMM inside any window.
    assert sum(plain) == 0, plain


@needs_tpu
def test_tpu_compiles_ragged_all_to_all():
    text = _compiled("tpu", 1, False, False)
    ragged = re.compile(r" ragged-all-to-all(?:-start)?\(")
    # Round 0's send and return in the ENTRY computation, the same two in the leftover loop.
    assert len(ragged.findall(text[text.index("ENTRY") :])) == 2
    assert len(ragged.findall(text)) == 4
