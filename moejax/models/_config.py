"""`LMConfig`: the frozen, validated description of a decoder-only MoE transformer.

Shape letters (docs/design.md): `B` batch, `S` sequence, `D` d_model, `F` d_ff, `E` experts,
`K` top-k, plus `V` vocabulary, `H` query heads, `Hkv` key/value heads, `Dh` head dim, `L` layers,
`Lm` MoE layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from moejax._config import MoEConfig

ComputeDtype = Literal["float32", "bfloat16"]
COMPUTE_DTYPES: tuple[str, ...] = ComputeDtype.__args__


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """A decoder-only transformer LM with MoE feed-forward layers. Frozen and validated.

    Pre-norm blocks: `x += attn(rms_norm(x))`, `x += ffn(rms_norm(x))`, a final RMSNorm, then the
    unembedding. Attention is causal with rotary position embeddings (RoPE, rotate-half form as
    in Llama/Mixtral) and grouped query heads (`num_kv_heads` key/value heads shared by
    `num_heads / num_kv_heads` query heads each). The FFN of layer `i` is the MoE layer `moe` when
    `i % moe_every == moe_every - 1` (every layer for `moe_every=1`, every second layer starting
    at layer 1 for 2, as in GShard/Switch), a dense SwiGLU MLP of width `dense_d_ff` elsewhere.

    Args:
      vocab_size: `V`; 256 for the byte-level tokenizer of `moejax.data`.
      d_model: `D`, the residual width; must equal `moe.d_model`.
      num_layers: `L` transformer blocks.
      num_heads: `H` query heads.
      num_kv_heads: `Hkv` key/value heads (GQA); divides `num_heads`. `num_heads` gives MHA, 1 MQA.
      head_dim: `Dh`, width of one head; even (RoPE rotates pairs).
      max_seq_len: `S`, the longest sequence the model is trained/evaluated on (RoPE tables and
        the data iterator's window length).
      moe: the MoE FFN layer (`moejax.MoEConfig`), including shared experts and routing.
      moe_every: the FFN of every `moe_every`-th layer is MoE (see above).
      dense_d_ff: hidden width of the dense SwiGLU layers (None: `moe.d_ff * moe.top_k`, the
        active expert width per token, so dense and MoE layers cost the same FLOPs per token).
      rope_theta: RoPE base frequency.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: use the embedding matrix (transposed) as the unembedding.
      dtype: compute dtype of activations and matmuls (`"bfloat16"`: mixed precision; the
        parameters stay in `param_dtype`, the router, softmaxes, norms' statistics and the loss
        stay fp32).
      param_dtype: dtype of the stored parameters (and the optimizer state).
      embed_init_std: standard deviation of the embedding initialiser.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    moe: MoEConfig
    moe_every: int = 1
    dense_d_ff: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: ComputeDtype = "float32"
    param_dtype: str = "float32"
    embed_init_std: float = 1.0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_seq_len",
            "moe_every",
        ):
            _positive_int(name, getattr(self, name))
        if self.dense_d_ff is not None:
            _positive_int("dense_d_ff", self.dense_d_ff)
        if not isinstance(self.moe, MoEConfig):
            _bad("moe", type(self.moe).__name__, "must be a moejax.MoEConfig")
        if self.moe.d_model != self.d_model:
            _bad("d_model", self.d_model, f"must equal moe.d_model={self.moe.d_model}")
        if self.num_heads % self.num_kv_heads:
            _bad("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            _bad("head_dim", self.head_dim, "must be even (RoPE rotates pairs of features)")
        if self.moe_every > self.num_layers:
            _bad("moe_every", self.moe_every, f"must be <= num_layers={self.num_layers}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            _bad("rope_theta", self.rope_theta, "must be a finite number > 1")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            _bad("norm_eps", self.norm_eps, "must be a finite number > 0")
        if self.dtype not in COMPUTE_DTYPES:
            _bad("dtype", self.dtype, f"must be one of {COMPUTE_DTYPES}")
        if self.param_dtype not in ("float32", "bfloat16"):
            _bad("param_dtype", self.param_dtype, "must be 'float32' or 'bfloat16'")
        if not self.embed_init_std > 0:
            _bad("embed_init_std", self.embed_init_std, "must be > 0")

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is MoE, in order (`Lm` of them)."""
        return tuple(i for i in range(self.num_layers) if i % self.moe_every == self.moe_every - 1)

    @property
    def num_moe_layers(self) -> int:
        """`Lm`, the number of MoE layers."""
        return len(self.moe_layers)

    @property
    def mlp_d_ff(self) -> int:
        """Hidden width of the dense SwiGLU layers."""
        return self.dense_d_ff or self.moe.d_ff * self.moe.top_k

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s FFN is the MoE layer."""
        return layer % self.moe_every == self.moe_every - 1

    def replace(self, **changes) -> LMConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _bad(field: str, value, why: str):
    raise ValueError(f"LMConfig.{field}={value!r}: {why}")


def _positive_int(field: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _bad(field, value, "must be a positive int")
