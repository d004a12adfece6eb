"""The causal attention core, chosen by compile target: flash-attention kernels on GPU and TPU.

`causal_attention(q, k, v)` is `softmax(q k^T * Dh**-0.5, causal) v` with grouped query heads,
scores and softmax in fp32. Four implementations:

- `"xla"`: the reference, the math of `moejax.models._layers.attention`: a grouped einsum with
  fp32 scores `[B, Hkv, R, S, S]`, the causal mask, an fp32 softmax, probabilities cast back to
  the input dtype. Memory grows as `S^2`; this is the oracle the kernels are tested against.
- `"cudnn"`: cuDNN's flash attention, forward and backward
  (`jax.nn.dot_product_attention(implementation="cudnn")`; custom calls `CUDNN_CALLS`), kv heads
  grouped as they are. NVIDIA GPUs only, and only where jax finds cuDNN (`jax[cuda]` installs
  it; for deviceless compiles `python -m pallas_kernels.targets --install` does) and cuDNN
  takes the shapes (`cudnn_fits`); a clear error otherwise.
- `"pallas"`: jax's shipped Pallas flash-attention kernels, forward and backward (each has a
  custom VJP with backward kernels), which hold one tile of scores at a time:

  * GPU (cuda, rocm): `jax.experimental.pallas.ops.gpu.attention.mha` (Triton), in the
    `[B, S, H, Dh]` layout; kernels `mha_forward`, `mha_preprocess_backward`, `mha_backward`.
  * TPU: `jax.experimental.pallas.ops.tpu.flash_attention.flash_attention` (Mosaic), in the
    `[B, H, S, Dh]` layout (transposed in and out); kernels `_flash_attention_kernel`,
    `_flash_attention_dkv_kernel`, `_flash_attention_dq_kernel`. Their `pallas_call`s carry no
    `name`, so `pallas_kernels.introspect.kernel_calls` lists them as `"kernel"` (backend
    "mosaic"); those are the names of their kernel functions.
  * CPU (and any other platform): the Triton kernel in interpret mode, which is what the CPU
    tests check against `"xla"`; slow, for small shapes.

  Both kernels want as many kv heads as query heads, so kv heads are repeated
  (`jnp.repeat(k, H // Hkv, axis=2)`: query head `h` reads kv head `h // (H // Hkv)`, as in the
  reference; autodiff sums the copies' gradients). Kernel bodies multiply at `DEFAULT`
  precision whatever `jax_default_matmul_precision` says (`_KernelPallas`).
- `"auto"`: by the platform the program is *compiled* for (`jax.lax.platform_dependent`, decided
  at lowering, never from the host): on cuda cuDNN's kernels where `cudnn_fits`, else the
  Triton kernel; the Triton kernel on rocm, the Mosaic kernel on TPU, `"xla"` on CPU. A
  deviceless compile for an H100 or TPU mesh on a CPU host holds the kernels. On an H200, at
  the Mixtral-8x7B shape (4 x 4096 tokens, 32 query and 8 kv heads of 128, bf16), forward and
  backward took 4.2 ms on cuDNN, 7.0 ms on the Triton kernel and 52 ms on `"xla"`
  (`experiments/bench_attention.py`).

Shapes a kernel cannot tile compute `"xla"` inside that platform's branch instead (decided from
static shapes when tracing; `kernel_fits`, `triton_blocks`, `mosaic_blocks`):

- Triton: `Dh` a power of two from 16 to 256; blocks of 128 rows, forward and backward (fewer
  where a row of `Dh` elements is over 256 bytes, to fit shared memory; the backward's then
  32); each block
  `min(block, S)`, a power of two >= 16 dividing `S` (in bf16 at `Dh <= 128`: `S` a multiple of
  128, or a power of two from 16 to 128).
- Mosaic: blocks of 128 rows everywhere (jax's defaults); `S` a multiple of 128, `Dh` below 128
  or a multiple of 128.

The Triton backward's blocks are the forward's where those are 128 rows (`triton_blocks`: jax's
default of 32 rows took 2.1x as long on an H200 at the Mixtral shape,
`experiments/bench_attention.py`); the Mosaic kernel's are jax's defaults. At `S = 4096,
Dh = 128` in bf16 both compile for their targets.

Variants the kernels lack (attention sinks, sliding windows, MLA's value head width differing
from the query/key one) compute `masked_attention` under a named scope (`XLA_SCOPES`), which
compiled programs keep in their op metadata, on every platform; `note_xla_fallback` says so once
per process, in one line on stderr, when a kernel could otherwise have run.

A kernel's custom VJP saves its inputs (kv heads repeated, and on TPU transposed) and per-row
softmax statistics, never scores.

With a `mesh`, the core runs inside `jax.shard_map(check_vma=True)` (XLA cannot partition a
Pallas custom call): batch over the token axes (`"data"`, `"fsdp"`, `"expert"`, those present,
in that order), query and kv heads over `"model"` if present (it must divide `Hkv`). Each
device's rows and kv-head groups are independent, so nothing is communicated. Without a mesh
the core may also be called inside a caller's `shard_map` (`_KernelPallas` types the kernels'
outputs there).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels import vma as _vma

IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")
# cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) in compiled
# programs: custom-call target -> the jax primitive that lowers to it (forward, backward).
CUDNN_CALLS = {
    "__cudnn$fmhaSoftmax": "dot_product_attention_fwd",
    "__cudnn$fmhaSoftmaxBackward": "dot_product_attention_bwd",
}
# jax's kernels: Triton pallas_call names; Mosaic kernel function names (their calls are unnamed).
TRITON_KERNELS = ("mha_forward", "mha_preprocess_backward", "mha_backward")
MOSAIC_KERNELS = (
    "_flash_attention_kernel",
    "_flash_attention_dkv_kernel",
    "_flash_attention_dq_kernel",
)

# Named scopes of the XLA attention that replaces the kernels (see the module docstring).
XLA_SCOPES = {"sinks_window": "xla_attention_sinks_window", "mla": "xla_attention_mla"}
_NOTED: set[str] = set()  # the fallbacks `note_xla_fallback` has reported in this process
_WHY = {
    "sinks_window": "attention sinks / sliding windows",
    "mla": "multi-head latent attention (value heads narrower than query/key heads)",
}
_TRITON_BLOCK = 128  # forward q and kv blocks
_TRITON_TILE_BYTES = 32 * 1024  # the most bytes of one forward tile (triton_blocks)
_TRITON_BWD_BLOCK = 32  # backward blocks where the forward's are narrower than 128 rows
_MOSAIC_BLOCK = 128


def _check(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, S, heads, Dh], got {q.shape}, {k.shape}, {v.shape}")
    b, s, h, dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != dh:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [{b}, {s}, Hkv, {dh}]")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"kv heads ({hkv}) must divide query heads ({h})")


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The reference core (`implementation="xla"`): the math of
    `moejax.models._layers.attention` after its projections and RoPE."""
    b, s, h, dh = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, s, hkv, h // hkv, dh)  # [B, S, Hkv, R, Dh]
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bgrst,btgk->bsgrk", probs, v).reshape(b, s, h, dh).astype(q.dtype)


def masked_attention(q, k, v, pos, *, scale: float, window=None, sinks=None, key_positions=None):
    """`softmax(q k^T * scale) v` of queries at `pos..pos+T-1` over keys `0..Smax-1`, keys after
    each query's position masked (grouped heads as `xla_attention`), the XLA path of every
    variant jax's flash-attention kernels lack.

    Args:
      q: `[B, T, H, Dk]`; k: `[B, Smax, Hkv, Dk]`; v: `[B, Smax, Hkv, Dv]`.
      pos: the position of `q[:, 0]` (an int or int32 scalar).
      scale: the score scale.
      window: None, or the sliding window: query `i` sees keys `i - window < j <= i`.
      sinks: None, or `[H]` logits that join each head's softmax denominator (GPT-OSS).
      key_positions: None (key `j` is at position `j`), or `[Smax]` int positions of the keys
        (a ring cache; negative: an empty slot, never visible).
    """
    b, t, h, dk = q.shape
    smax, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    q = q.reshape(b, t, hkv, h // hkv, dk)
    k = k.astype(q.dtype)
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k, preferred_element_type=jnp.float32) * scale
    qpos = (pos + jnp.arange(t))[:, None]
    kpos = (jnp.arange(smax) if key_positions is None else key_positions)[None, :]
    visible = (kpos <= qpos) & (kpos >= 0)  # [T, Smax]
    if window is not None:
        visible = visible & (qpos - kpos < window)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    else:  # one more logit per head in the denominator, its probability dropped
        sink = sinks.astype(jnp.float32).reshape(1, hkv, h // hkv, 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)
        probs = probs[..., :-1].astype(q.dtype)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs, v.astype(q.dtype))
    return out.reshape(b, t, h, dv).astype(q.dtype)


def note_xla_fallback(kind: str, implementation: str) -> None:
    """One line on stderr, once per process and `kind` (a key of `XLA_SCOPES`), that layers of
    that kind use the XLA attention core where `implementation` ("auto" or "pallas") would have
    run jax's flash-attention kernels; nothing for `implementation="xla"`."""
    if implementation == "xla" or kind in _NOTED:
        return
    _NOTED.add(kind)
    print(
        f"moejax: {_WHY[kind]}: the flash-attention kernels (cuDNN's or Triton on GPU, Mosaic "
        "on TPU) "
        f"lack them; those layers use the XLA attention core (named scope {XLA_SCOPES[kind]!r} "
        "in the compiled program)",
        file=sys.stderr,
        flush=True,
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_blocks(seq_len: int, head_dim: int, dtype) -> tuple[int, int] | None:
    """`(forward, backward)` block rows of the Triton kernel, or None where it cannot tile.

    Forward blocks hold `rows x Dh` tiles of q, and of k and v in `num_stages=2` pipeline
    stages: 128 rows, fewer where a row is over 256 bytes (`rows * Dh * itemsize <= 32 KiB`),
    which keeps every tile set within H100's 232,448 bytes of shared memory per block (fp32 at
    `Dh = 128` with 128 rows asks for 262,144). Backward blocks: the forward's where those are
    128 rows (jax then picks 8 warps; at the Mixtral shape on an H200 2.1x as fast as jax's
    default of 32 rows, though ptxas reports 252 bytes of spill stores), else jax's 32 (64-row
    backward blocks of fp32 or of `Dh = 256` spill kilobytes, and were not measured). Every
    block must be a power of two >= 16 dividing `S` (`tl.dot` wants dimensions >= 16), and `Dh`
    a power of two from 16 to 256.
    """
    s, dh = seq_len, head_dim
    if not (_pow2(dh) and 16 <= dh <= 256):
        return None
    fwd = min(_TRITON_BLOCK, _TRITON_TILE_BYTES // (dh * jnp.dtype(dtype).itemsize), s)
    bwd = fwd if fwd == min(_TRITON_BLOCK, s) else min(_TRITON_BWD_BLOCK, s)
    if all(_pow2(x) and x >= 16 and s % x == 0 for x in (fwd, bwd)):
        return fwd, bwd
    return None


def mosaic_blocks(seq_len: int, head_dim: int) -> int | None:
    """The block rows of the Mosaic kernel (every one of its blocks), or None where it cannot
    tile: `S` must be a multiple of 128 (its kv blocks are multiples of 128 lanes), `Dh` below
    128 or a multiple of 128."""
    if seq_len % _MOSAIC_BLOCK == 0 and (head_dim < 128 or head_dim % 128 == 0):
        return _MOSAIC_BLOCK
    return None


def kernel_fits(kernel: str, seq_len: int, head_dim: int, dtype=jnp.bfloat16) -> bool:
    """Whether `kernel` ("triton" or "mosaic") tiles `[S, Dh]` heads of `dtype`; where not,
    that platform's branch computes `"xla"` instead."""
    if kernel == "triton":
        return triton_blocks(seq_len, head_dim, dtype) is not None
    if kernel == "mosaic":
        return mosaic_blocks(seq_len, head_dim) is not None
    raise ValueError(f"kernel must be 'triton' or 'mosaic', got {kernel!r}")


def _repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    return jnp.repeat(x, heads // x.shape[2], axis=2) if x.shape[2] != heads else x


def _typed_out_shape(shape, like: jax.Array, axes: frozenset):
    if isinstance(shape, jax.ShapeDtypeStruct) and shape.manual_axis_type is not None:
        return shape
    return _vma.out_struct(shape.shape, shape.dtype, like, axes)


class _KernelPallas:
    """`jax.experimental.pallas` as jax's attention kernels see it (`_kernels`): the same module
    but for `pallas_call`, which here

    - runs inside `jax.shard_map(check_vma=True)`. There a `pallas_call`'s `out_shape` must say
      over which mesh axes the output varies; jax 0.10's attention kernels give plain
      `ShapeDtypeStruct`s, which it rejects ("`manual_axis_type` on `jax.ShapeDtypeStruct` must
      not be `None`"), or the tracer `q`, which would type the output as varying over none.
      As this package's own kernels do (`pallas_kernels.vma`), the operands are cast to the
      mesh axes any of them varies over and every output is typed as varying over those axes,
      which it does (each device attends over its own rows). Outside shard_map nothing varies
      and this does nothing.
    - traces the kernel body at `DEFAULT` matmul precision whatever
      `jax_default_matmul_precision` says, as this package's kernels multiply (docs/design.md,
      "Precision"): under "highest" Mosaic rejects bf16 operands ("Bad lhs type") and Triton
      would take its IEEE fp32 path.

    It replaces the module the kernels call, not a context around calling them, because each
    kernel's custom VJP traces its backward kernels later, when the program is transposed; it
    does so in private copies of jax's two modules (`_private_copy`), never in jax's own.
    """

    def __init__(self, pallas):
        self._pallas = pallas

    def __getattr__(self, name):
        return getattr(self._pallas, name)

    def pallas_call(self, kernel, out_shape, **kwargs):
        make = self._pallas.pallas_call

        def call(*operands):
            arrays = [x for x in jax.tree.leaves(operands) if isinstance(x, jax.Array)]
            axes = _vma.varying_axes(*arrays)
            if axes:
                operands = jax.tree.map(
                    lambda x: _vma.cast_varying(x, axes) if isinstance(x, jax.Array) else x,
                    operands,
                )
                out_shape_ = jax.tree.map(lambda s: _typed_out_shape(s, arrays[0], axes), out_shape)
            else:
                out_shape_ = out_shape
            with jax.default_matmul_precision("default"):
                return make(kernel, out_shape_, **kwargs)(*operands)

        return call


def _private_copy(name: str):
    """A fresh instance of module `name` (its file run again into a new module, registered as
    `moejax.models._attention.<last part of name>`), its `pl` made `_KernelPallas`: jax's own
    module, and anyone else's use of it, stay untouched."""
    origin = importlib.util.find_spec(name).origin
    private = f"{__name__}.{name.rsplit('.', 1)[-1]}"
    spec = importlib.util.spec_from_file_location(private, origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module  # dataclasses resolve annotations through sys.modules
    with warnings.catch_warnings():
        # jax 0.11 deprecated its Triton attention module (pointing to tokamax); it stays our
        # flash-attention fallback on GPU while jax ships it. Its kernels' lowering warns too
        # (Pallas-Triton; filtered in pallas_kernels.triton).
        warnings.filterwarnings(
            "ignore", message=r"jax\.experimental\.pallas\.ops\.gpu\.attention is deprecated"
        )
        spec.loader.exec_module(module)
    module.pl = _KernelPallas(module.pl)
    return module


@functools.cache
def _kernels():
    """Private copies of jax's GPU (Triton) and TPU (Mosaic) attention modules, whose Pallas is
    `_KernelPallas`."""
    return (
        _private_copy("jax.experimental.pallas.ops.gpu.attention"),
        _private_copy("jax.experimental.pallas.ops.tpu.flash_attention"),
    )


def _triton(q, k, v, *, interpret: bool = False):
    if interpret:  # the interpreted kernel inside the check_vma shard_map of `_sharded`
        _vma.install_interpret_fix()
    gpu_attention, _ = _kernels()
    b, s, h, dh = q.shape
    tiles = triton_blocks(s, dh, q.dtype)
    if tiles is None:
        return xla_attention(q, k, v)
    fwd, bwd = tiles
    blocks = gpu_attention.BlockSizes(
        block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd
    )
    k, v = _repeat_kv(k.astype(q.dtype), h), _repeat_kv(v.astype(q.dtype), h)
    return gpu_attention.mha(
        q, k, v, None, sm_scale=dh**-0.5, causal=True, block_sizes=blocks, interpret=interpret
    )


def _mosaic(q, k, v):
    _, tpu_attention = _kernels()
    b, s, h, dh = q.shape
    n = mosaic_blocks(s, dh)
    if n is None:
        return xla_attention(q, k, v)
    blocks = tpu_attention.BlockSizes(
        block_q=n, block_k_major=n, block_k=n, block_b=1,
        block_q_major_dkv=n, block_k_major_dkv=n, block_k_dkv=n, block_q_dkv=n,
        block_k_major_dq=n, block_k_dq=n, block_q_dq=n,
    )  # fmt: skip
    k, v = _repeat_kv(k.astype(q.dtype), h), _repeat_kv(v.astype(q.dtype), h)
    bhsd = lambda x: x.transpose(0, 2, 1, 3)  # [B, S, H, Dh] <-> [B, H, S, Dh]
    out = tpu_attention.flash_attention(
        bhsd(q), bhsd(k), bhsd(v), causal=True, sm_scale=dh**-0.5, block_sizes=blocks
    )
    return bhsd(out)


def _cudnn_call(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, scale=q.shape[-1] ** -0.5, is_causal=True, implementation="cudnn"
    )


@functools.cache
def _cudnn_takes(q_struct, kv_struct) -> str | None:
    """Why cuDNN's flash attention cannot run this forward and backward where jax traces it
    (no cuDNN installed, a head width or dtype it lacks), or None where it can."""

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(_cudnn_call, q, k, v)
        return vjp(out)

    try:
        jax.eval_shape(fwd_bwd, q_struct, kv_struct, kv_struct)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _cudnn_why(q, k) -> str | None:
    """`_cudnn_takes` for this core: k and v in q's dtype, as `_cudnn` passes them."""
    return _cudnn_takes(
        jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, q.dtype)
    )


def cudnn_fits(q, k) -> bool:
    """Whether cuDNN's flash attention runs this core, forward and backward, here: jax finds
    cuDNN (jax[cuda] installs it) and takes the shapes (`jax.nn.dot_product_attention`); where
    not, `"auto"` runs the Triton kernel on GPU."""
    return _cudnn_why(q, k) is None


def _cudnn(q, k, v):
    why = _cudnn_why(q, k)
    if why is not None:
        raise ValueError(
            f"implementation='cudnn' cannot run q {q.shape} {q.dtype}, k/v {k.shape} here: {why}"
        )
    return _cudnn_call(q, k.astype(q.dtype), v.astype(q.dtype))


def _gpu(q, k, v):
    """`"auto"` on cuda: cuDNN's flash attention where it runs (`cudnn_fits`), else Triton."""
    return _cudnn(q, k, v) if cudnn_fits(q, k) else _triton(q, k, v)


def _core(q, k, v, implementation: str):
    if implementation == "xla":
        return xla_attention(q, k, v)
    if implementation == "cudnn":
        return _cudnn(q, k, v)
    if implementation == "auto":
        default, cuda = xla_attention, _gpu
    else:  # "pallas": the Triton kernel, interpreted, where neither compiled kernel runs
        default, cuda = functools.partial(_triton, interpret=True), _triton
    return jax.lax.platform_dependent(
        q, k, v, cuda=cuda, rocm=_triton, tpu=_mosaic, default=default
    )


def _sharded(q, k, v, mesh, implementation: str):
    from moejax.parallel import mesh as mesh_lib

    b, h, hkv = q.shape[0], q.shape[2], k.shape[2]
    token = mesh_lib.token_axes(mesh)  # "data", "fsdp", "expert": those present, in order
    shards = math.prod(mesh_lib.axis_size(mesh, a) for a in token)
    if b % shards:
        raise ValueError(f"batch {b} is not divisible by the {shards} devices of {token}")
    model = mesh_lib.MODEL if mesh_lib.MODEL in mesh.axis_names else None
    if model is not None and hkv % mesh_lib.axis_size(mesh, model):
        raise ValueError(
            f"kv heads ({hkv}; query heads {h}) are not divisible by the "
            f"{mesh_lib.axis_size(mesh, model)} devices of the {model!r} mesh axis"
        )
    spec = PartitionSpec(token or None, None, model, None)
    body = functools.partial(_core, implementation=implementation)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=True
    )(q, k, v)


def causal_attention(q, k, v, *, mesh=None, implementation: str = "auto") -> jax.Array:
    """Causal self-attention core with grouped query heads (module docstring).

    Args:
      q: `[B, S, H, Dh]` queries (after RoPE).
      k, v: `[B, S, Hkv, Dh]`; `Hkv` divides `H` and query head `h` reads kv head
        `h // (H // Hkv)`.
      mesh: optional `jax.sharding.Mesh` (axes among "data", "fsdp", "expert", "model"); the
        core then runs under `shard_map`, batch over the token axes, heads over "model" (which
        must divide `Hkv`).
      implementation: "auto", "xla", "pallas" or "cudnn" (module docstring).

    Returns:
      `[B, S, H, Dh]` in `q.dtype`: `softmax(q k^T * Dh**-0.5, causal) v`, scores and softmax
      in fp32.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 4, 2, 8))  # equal scores: uniform weights over the past
    >>> kv = jnp.broadcast_to(jnp.arange(4.0)[None, :, None, None], (1, 4, 1, 8))
    >>> causal_attention(q, kv, kv)[0, :, 0, 0].tolist()
    [0.0, 0.5, 1.0, 1.5]
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    _check(q, k, v)
    if mesh is None:
        return _core(q, k, v, implementation)
    return _sharded(q, k, v, mesh, implementation)
