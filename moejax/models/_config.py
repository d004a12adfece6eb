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
from moejax.models._mla import MLAConfig

ComputeDtype = Literal["float32", "bfloat16"]
COMPUTE_DTYPES: tuple[str, ...] = ComputeDtype.__args__
QKNorm = Literal["head", "full"]
QK_NORMS: tuple[str, ...] = QKNorm.__args__
RopeKind = Literal["linear", "llama3", "yarn"]
ROPE_KINDS: tuple[str, ...] = RopeKind.__args__
MlpKind = Literal["dense", "moe"]
MLP_KINDS: tuple[str, ...] = MlpKind.__args__
AttentionKind = Literal["full_attention", "sliding_attention"]
ATTENTION_KINDS: tuple[str, ...] = AttentionKind.__args__
MtpInput = Literal[
    "final_norm",  # h^0 = the final norm's output (what the unembedding reads): serving stacks
    "pre_norm",  # h^0 = the last block's output, before the final norm (MaxText)
]
MTP_INPUTS: tuple[str, ...] = MtpInput.__args__


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
    at layer 1 for 2, as in GShard/Switch), a dense SwiGLU MLP of width `dense_d_ff` elsewhere;
    or, with `mlp_layer_types`, whatever that per-layer list says (dense and MoE layers at any
    positions: DeepSeek-V3's dense first layers, Qwen's `mlp_only_layers`;
    `moejax.models.mlp_layer_types_of` reads Hugging Face configs' spellings into it).

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
      mlp_layer_types: None (the `moe_every` pattern), or one entry per layer, `"dense"` or
        `"moe"` (a list is stored as a tuple); excludes `moe_every != 1`.
      dense_d_ff: hidden width of the dense SwiGLU layers (None: `moe.d_ff * moe.top_k`, the
        active expert width per token, so dense and MoE layers cost the same FLOPs per token).
      mtp_layers: multi-token-prediction blocks (DeepSeek-V3's `num_nextn_predict_layers`):
        block `k` (1-based) predicts token `t + k + 1` from the previous block's hidden state
        (the main model's for `k = 1`; which one: `mtp_input`) and the embedding of token
        `t + k`, sharing the embedding and unembedding (`moejax.models._mtp`). Training only
        (`TrainConfig.mtp_loss_weight`); `lm_forward` runs them when given `mtp_tokens`,
        generation never does.
      mtp_input: the hidden state each MTP block reads from the one before. `"final_norm"`
        (the default): the main model's final-normed state, the one its unembedding reads,
        and each block's normed output for the next, as vLLM, SGLang, Megatron-Core and
        transformers' `MtpModel` drafting feed them: a block trained so serves as their draft
        model. `"pre_norm"`: the last block's output before the final norm, and each block's
        output before its norm (MaxText).
      rope_theta: RoPE base frequency.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: use the embedding matrix (transposed) as the unembedding.
      qk_norm: RMSNorm on queries and keys after their projections, before RoPE (None: off):
        `"head"` normalises each head over `Dh` with one `[Dh]` gain shared by the heads
        (Qwen3-MoE), `"full"` normalises all heads together over `H * Dh` (resp. `Hkv * Dh`)
        with a gain per feature (OLMoE).
      attention_bias: the query, key and value projections have biases (Qwen2-MoE).
      attention_out_bias: the output projection has a bias (Qwen3-MoE with `attention_bias`).
      attention_sinks: every attention layer has a learned logit per query head in its
        softmax's denominator (`attn/sinks [H]`; GPT-OSS): `p_j = exp(s_j) / (exp(sink) +
        sum_k exp(s_k))`.
      layer_types: None (every layer attends to its whole past), or one entry per layer,
        `"full_attention"` or `"sliding_attention"` (Hugging Face's `layer_types`; a list is
        stored as a tuple); sliding layers see the last `sliding_window` positions (a query
        at `i` sees keys `j` with `i - sliding_window < j <= i`).
      sliding_window: the window of the sliding layers (needed with any).
      mla: None (grouped-query attention), or a `moejax.models.MLAConfig`: multi-head latent
        attention (DeepSeek-V2/V3, Kimi K2; `moejax.models._mla`). It needs
        `num_kv_heads == num_heads`, `head_dim == mla.qk_head_dim`, no `qk_norm` and no
        attention biases; RoPE then covers the `mla.qk_rope_head_dim` rotary features.
      rope_scaling: None, or a `RopeScaling` that stretches the RoPE frequencies.
      partial_rotary_factor: the share of each head's features RoPE rotates: the first
        `rope_dim = int(head_dim * partial_rotary_factor)` (rotate-half within them, frequencies
        over `rope_dim`), the rest pass through (GLM-4.5: 0.5; Hugging Face's
        `partial_rotary_factor`). In (0, 1]; 1 (the default) rotates all. MLA has its own
        rotary features (`mla.qk_rope_head_dim`) and needs 1.
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
    mlp_layer_types: tuple[MlpKind, ...] | None = None
    dense_d_ff: int | None = None
    mtp_layers: int = 0
    mtp_input: MtpInput = "final_norm"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: QKNorm | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    attention_sinks: bool = False
    layer_types: tuple[AttentionKind, ...] | None = None
    sliding_window: int | None = None
    mla: MLAConfig | None = None
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
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
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int):
            _bad("mtp_layers", self.mtp_layers, "must be an int >= 0")
        if self.mtp_layers < 0:
            _bad("mtp_layers", self.mtp_layers, "must be an int >= 0")
        if self.mtp_input not in MTP_INPUTS:
            _bad("mtp_input", self.mtp_input, f"must be one of {MTP_INPUTS}")
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
        if self.mlp_layer_types is not None:
            self._check_mlp_layer_types()
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            _bad("rope_theta", self.rope_theta, "must be a finite number > 1")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            _bad("norm_eps", self.norm_eps, "must be a finite number > 0")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            _bad("qk_norm", self.qk_norm, f"must be None or one of {QK_NORMS}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _bad("rope_scaling", self.rope_scaling, "must be None or a RopeScaling")
        self._check_partial_rotary()
        if self.layer_types is not None or self.sliding_window is not None:
            self._check_layer_types()
        if self.mla is not None:
            self._check_mla()
        if self.dtype not in COMPUTE_DTYPES:
            _bad("dtype", self.dtype, f"must be one of {COMPUTE_DTYPES}")
        if self.param_dtype not in ("float32", "bfloat16"):
            _bad("param_dtype", self.param_dtype, "must be 'float32' or 'bfloat16'")
        if not self.embed_init_std > 0:
            _bad("embed_init_std", self.embed_init_std, "must be > 0")

    def _check_mla(self):
        if not isinstance(self.mla, MLAConfig):
            _bad("mla", self.mla, "must be None or a moejax.models.MLAConfig")
        if self.num_kv_heads != self.num_heads:
            _bad("num_kv_heads", self.num_kv_heads, f"must equal num_heads={self.num_heads} (MLA)")
        if self.head_dim != self.mla.qk_head_dim:
            _bad("head_dim", self.head_dim, f"must equal mla.qk_head_dim={self.mla.qk_head_dim}")
        for name in ("qk_norm", "attention_bias", "attention_out_bias", "attention_sinks"):
            if getattr(self, name):
                _bad(name, getattr(self, name), "is not supported with mla")

    def _check_layer_types(self):
        kinds = self.layer_types
        if isinstance(kinds, list):
            kinds = tuple(kinds)
            object.__setattr__(self, "layer_types", kinds)
        if kinds is not None:
            if not isinstance(kinds, tuple) or len(kinds) != self.num_layers:
                _bad("layer_types", kinds, f"must be a tuple of num_layers={self.num_layers}")
            if bad := [k for k in kinds if k not in ATTENTION_KINDS]:
                _bad("layer_types", kinds, f"entries {bad} are not among {ATTENTION_KINDS}")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if kinds is not None and "sliding_attention" in kinds and self.sliding_window is None:
            _bad("sliding_window", None, "layer_types has sliding_attention layers: give it")
        if self.mla is not None and self.sliding_window is not None:
            _bad("sliding_window", self.sliding_window, "is not supported with mla")

    def window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: its whole past)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def layer_kinds(self) -> tuple[tuple[str, int | None], ...]:
        """`(MLP kind, attention window)` of every layer: layers with equal kinds are
        interchangeable units for `lm_forward(scan_layers=True)`."""
        return tuple((k, self.window(i)) for i, k in enumerate(self.mlp_kinds))

    def _check_mlp_layer_types(self):
        kinds = self.mlp_layer_types
        if isinstance(kinds, list):  # hashable, as a frozen config must be (jit static args)
            kinds = tuple(kinds)
            object.__setattr__(self, "mlp_layer_types", kinds)
        if not isinstance(kinds, tuple):
            _bad("mlp_layer_types", kinds, "must be None or a tuple of 'dense' / 'moe'")
        if len(kinds) != self.num_layers:
            _bad(
                "mlp_layer_types",
                kinds,
                f"has {len(kinds)} entries: need one per layer (num_layers={self.num_layers})",
            )
        if bad := [k for k in kinds if k not in MLP_KINDS]:
            _bad("mlp_layer_types", kinds, f"entries {bad} are not among {MLP_KINDS}")
        if self.moe_every != 1:
            _bad("moe_every", self.moe_every, "must be 1 when mlp_layer_types is given")

    def _check_partial_rotary(self) -> None:
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            _bad("partial_rotary_factor", f, "must be a number in (0, 1]")
        if f == 1:
            return
        if self.mla is not None:
            _bad("partial_rotary_factor", f, "must be 1 with mla (mla.qk_rope_head_dim says it)")
        rotated = int(self.head_dim * f)
        if rotated < 2 or rotated % 2:
            _bad(
                "partial_rotary_factor", f,
                f"rotates int(head_dim={self.head_dim} * {f}) = {rotated} features: need an "
                "even number >= 2 (RoPE rotates pairs)",
            )  # fmt: skip

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def mlp_kinds(self) -> tuple[str, ...]:
        """The FFN of every layer, `"dense"` or `"moe"` (`mlp_layer_types`, or the `moe_every`
        pattern)."""
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types
        u = self.moe_every
        return tuple("moe" if i % u == u - 1 else "dense" for i in range(self.num_layers))

    @property
    def rope_dim(self) -> int:
        """The features of a head RoPE rotates: the first `int(head_dim *
        partial_rotary_factor)` (all of `head_dim` by default), or MLA's `qk_rope_head_dim`."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is MoE, in order (`Lm` of them)."""
        return tuple(i for i, kind in enumerate(self.mlp_kinds) if kind == "moe")

    @property
    def num_moe_layers(self) -> int:
        """`Lm`, the number of MoE layers."""
        return len(self.moe_layers)

    @property
    def mlp_d_ff(self) -> int:
        """Hidden width of the dense SwiGLU layers."""
        return self.dense_d_ff or self.moe.d_ff * self.moe.top_k

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the multi-token-prediction blocks' FFN is MoE (as the last layer's)."""
        return self.mlp_kinds[-1] == "moe"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s FFN is the MoE layer."""
        return self.mlp_kinds[layer] == "moe"

    def replace(self, **changes) -> LMConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _bad(field: str, value, why: str):
    raise ValueError(f"LMConfig.{field}={value!r}: {why}")


def _positive_int(field: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _bad(field, value, "must be a positive int")
