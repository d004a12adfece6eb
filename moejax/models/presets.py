"""Model presets: frozen `LMConfig`s, looked up by name with `get`.

| name | what for | params total / active |
|---|---|---|
| `micro` | tests: sigmoid routing, correction bias, shared expert; tiny sizes | 75 K / 30 K |
| `micro_dense` | `micro` made dense (MLPs of 64), a run to upcycle into `micro` | 35 K / 27 K |
| `tiny` | the README's main job: minutes on 2 CPU cores, 8 simulated devices | 3.4 M / 1.0 M |
| `small` | bigger CPU runs, benchmark; DeepSeek-style routing + shared expert | 41 M / 8.4 M |
| `mixtral_8x7b` | Mixtral-8x7B's shapes, for accelerators (not built in tests) | 46.7 B / 12.7 B |
| `fine_grained_64x1408` | DeepSeek-style: 64 experts of 1408, top-6, 2 shared | 16.9 B / 2.6 B |
| `deepseek_v3_4l` | DeepSeek-V3's widths (MLA, 256 experts of 2048), 4 layers | 37.0 B / 3.3 B |

"Active" counts the parameters that multiply one token (`moejax.models.param_counts`).

Training hyper-parameters that go with each preset live in `moejax.training.presets`.

>>> from moejax.models import presets
>>> presets.get("tiny").moe.num_experts
8
"""

from __future__ import annotations

from moejax._config import MoEConfig
from moejax.models._config import LMConfig, RopeScaling
from moejax.models._mla import MLAConfig
from moejax.presets import deepseek_v3

# Tests: every routing feature the training loop handles (sigmoid scores, the correction bias
# updated outside the optimizer, a shared expert) at sizes that compile and step in seconds.
MICRO = LMConfig(
    vocab_size=256,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_seq_len=16,
    moe=MoEConfig(
        d_model=32,
        d_ff=32,
        num_experts=8,
        top_k=2,
        router="sigmoid",
        score_correction_bias=True,
        num_shared_experts=1,
        shared_d_ff=16,
        block_size=8,
    ),
)

# MICRO made dense (`moejax.models.dense_lm_config(MICRO, d_ff=64)`): every feed-forward layer a
# SwiGLU MLP of width 64, written as a one-expert MoE layer, for a dense run to upcycle from
# (`train_lm.py --preset micro --upcycle-from <its run> --upcycle-granularity 2`: 2 x 32 = 64).
MICRO_DENSE = MICRO.replace(
    moe=MoEConfig(d_model=32, d_ff=64, num_experts=1, top_k=1, router="softmax", block_size=8),
    moe_every=1,
    dense_d_ff=None,
)

# Byte-level, 4 blocks of MoE (8 experts, top-2) at width 128: big enough to learn Python syntax
# well below the unigram entropy in a few hundred steps, small enough for 2 CPU cores. The block
# size 32 keeps the blocked grouped matmul's padding small at ~128 rows per local expert.
TINY = LMConfig(
    vocab_size=256,
    d_model=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_seq_len=128,
    moe=MoEConfig(d_model=128, d_ff=256, num_experts=8, top_k=2, block_size=32),
)

# DeepSeek-V3-style routing: sigmoid scores, aux-loss-free balancing through the correction
# bias (updated outside the optimizer), one always-on shared expert; 16 experts, top-2.
SMALL = LMConfig(
    vocab_size=256,
    d_model=256,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    max_seq_len=256,
    moe=MoEConfig(
        d_model=256,
        d_ff=512,
        num_experts=16,
        top_k=2,
        router="sigmoid",
        score_correction_bias=True,
        num_shared_experts=1,
        block_size=64,
    ),
)

# Mixtral-8x7B (Jiang et al. 2024; the `mistralai/Mixtral-8x7B-v0.1` config): 32 layers,
# d_model 4096, 32 query / 8 kv heads of 128, 8 experts of d_ff 14336, top-2, vocab 32000,
# rope_theta 1e6. bf16 compute with fp32 master weights.
MIXTRAL_8X7B = LMConfig(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_seq_len=4096,
    rope_theta=1e6,
    dtype="bfloat16",
    moe=MoEConfig(d_model=4096, d_ff=14336, num_experts=8, top_k=2, block_size=512),
)

# Fine-grained experts with DeepSeek routing, at the shapes of DeepSeekMoE-16B (Dai et al. 2024):
# 28 layers, d_model 2048, 16 heads of 128, 64 routed experts of d_ff 1408, top-6, 2 shared
# experts, vocab 102400; DeepSeek-V3's router (sigmoid scores, correction bias, 8 groups of which
# a token may reach 4). Named after its shapes: this is not a checkpoint moejax loads.
FINE_GRAINED_64X1408 = LMConfig(
    vocab_size=102400,
    d_model=2048,
    num_layers=28,
    num_heads=16,
    num_kv_heads=16,
    head_dim=128,
    max_seq_len=4096,
    dtype="bfloat16",
    moe=deepseek_v3(
        d_model=2048,
        d_ff=1408,
        num_experts=64,
        top_k=6,
        num_groups=8,
        topk_groups=4,
        routed_scaling_factor=1.0,
        num_shared_experts=2,
        block_size=256,
    ),
)

# DeepSeek-V3's widths (the `deepseek-ai/DeepSeek-V3` config) at reduced depth: d_model 7168,
# 128 heads of multi-head latent attention (q rank 1536, kv rank 512, 128 + 64 rotary features
# per query/key head, values of 128), yarn RoPE (factor 40 over 4096), 256 routed experts of
# 2048, top-8 in 8 groups of which 4, one shared expert, a dense first layer of 18432, vocab
# 129280. Four layers, one dense then three MoE: every kind of block the 61 layers hold, for
# `experiments/plan_scale.py` to size one layer-unit (`num_layers=61` with 3 dense layers is the
# published model: 671 B parameters, 37 B active).
DEEPSEEK_V3_4L = LMConfig(
    vocab_size=129280,
    d_model=7168,
    num_layers=4,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,
    max_seq_len=4096,
    mlp_layer_types=("dense", "moe", "moe", "moe"),
    dense_d_ff=18432,
    norm_eps=1e-6,
    mla=MLAConfig(
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        q_lora_rank=1536,
    ),
    rope_scaling=RopeScaling(
        "yarn", 40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    ),
    dtype="bfloat16",
    moe=deepseek_v3(
        d_model=7168, d_ff=2048, num_experts=256, top_k=8, num_groups=8, topk_groups=4,
        block_size=256,
    ),
)  # fmt: skip

PRESETS: dict[str, LMConfig] = {
    "micro": MICRO,
    "tiny": TINY,
    "small": SMALL,
    "mixtral_8x7b": MIXTRAL_8X7B,
    "fine_grained_64x1408": FINE_GRAINED_64X1408,
    "deepseek_v3_4l": DEEPSEEK_V3_4L,
    "micro_dense": MICRO_DENSE,
}
# Accelerators only, and planned to fit 64 devices (tests/accelerator); `deepseek_v3_4l` is
# sized on demand (`experiments/plan_scale.py --preset deepseek_v3_4l`).
REAL_SIZE: tuple[str, ...] = ("mixtral_8x7b", "fine_grained_64x1408")
# The published depth of the presets that keep a model's widths at reduced depth: the FFN kind of
# every layer (`plan_scale.py` sizes the whole model's state from one layer of each kind).
FULL_DEPTH: dict[str, tuple[str, ...]] = {"deepseek_v3_4l": ("dense",) * 3 + ("moe",) * 58}


def get(name: str) -> LMConfig:
    """The preset `name` (see the module docstring).

    Raises:
      ValueError: naming the unknown preset and the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
