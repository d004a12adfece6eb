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
QKNorm = Literal["head", "full"]
QK_NORMS: tuple[str, ...] = QKNorm.__args__
RopeKind = Literal["linear", "llama3", "yarn"]
ROPE_KINDS: tuple[str, ...] = RopeKind.__args__


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for contexts past the pretraining length (the
    `rope_scaling` types of Hugging Face's `modeling_rope_utils`; formulas in
    `moejax.models._layers.rope_frequencies`).

    Args:
      kind: `"linear"` (positions divided by `factor`), `"llama3"` (low frequencies divided by
        `factor`, high ones kept, a smooth ramp between) or `"yarn"` (NTK-by-parts ramp between
        interpolated and extrapolated frequencies, and cos/sin scaled by an attention factor).
      factor: the stretch factor (> 0).
      original_max_position_embeddings: the pretraining context (llama3, yarn; needed there).
      low_freq_factor, high_freq_factor: llama3's wavelength bounds of the ramp.
      beta_fast, beta_slow: yarn's ramp bounds in rotations.
      attention_factor: yarn's cos/sin scale (None: `0.1 * ln(factor) + 1`, or the ratio of
        `mscale` and `mscale_all_dim` forms when both are given).
      mscale, mscale_all_dim: yarn's DeepSeek-style attention-factor terms.
      truncate: yarn rounds the ramp bounds to integers.
    """

    kind: RopeKind
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}: must be one of {ROPE_KINDS}")
        if not (isinstance(self.factor, int | float) and math.isfinite(self.factor)):
            raise ValueError(f"RopeScaling.factor={self.factor!r}: must be a finite number")
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor={self.factor!r}: must be > 0")
        if self.kind in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(
                f"RopeScaling.original_max_position_embeddings=None: kind={self.kind!r} needs it"
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor!r}: must be > "
                f"low_freq_factor={self.low_freq_factor!r}"
            )


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
      qk_norm: RMSNorm on queries and keys after their projections, before RoPE (None: off):
        `"head"` normalises each head over `Dh` with one `[Dh]` gain shared by the heads
        (Qwen3-MoE), `"full"` normalises all heads together over `H * Dh` (resp. `Hkv * Dh`)
        with a gain per feature (OLMoE).
      attention_bias: the query, key and value projections have biases (Qwen2-MoE).
      attention_out_bias: the output projection has a bias (Qwen3-MoE with `attention_bias`).
      rope_scaling: None, or a `RopeScaling` that stretches the RoPE frequencies.
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
    qk_norm: QKNorm | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    rope_scaling: RopeScaling | None = None
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
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            _bad("qk_norm", self.qk_norm, f"must be None or one of {QK_NORMS}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _bad("rope_scaling", self.rope_scaling, "must be None or a RopeScaling")
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
