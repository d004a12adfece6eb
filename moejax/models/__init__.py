"""moejax.models: a decoder-only MoE transformer LM over a plain parameter tree.

RMSNorm, RoPE, causal attention with grouped query heads, and the moejax MoE layer (with
optional shared experts) as the FFN of every layer or every n-th; functional, so the tree is easy
to shard, checkpoint and re-place.

>>> import jax, jax.numpy as jnp
>>> from moejax import models
>>> cfg = models.presets.get("micro")
>>> params = models.init_lm_params(cfg, jax.random.key(0))
>>> logits, aux = models.lm_forward(params, jnp.zeros((2, 16), jnp.int32), cfg)
>>> logits.shape, aux.expert_counts.shape
((2, 16, 256), (2, 8))
"""

from moejax.models import presets as presets
from moejax.models._attention import causal_attention as causal_attention
from moejax.models._config import LMConfig as LMConfig
from moejax.models._config import RopeScaling as RopeScaling
from moejax.models._generate import generate as generate
from moejax.models._layers import apply_rope as apply_rope
from moejax.models._layers import attention as attention
from moejax.models._layers import rms_norm as rms_norm
from moejax.models._layers import rope_frequencies as rope_frequencies
from moejax.models._layers import rope_tables as rope_tables
from moejax.models._layers import swiglu_mlp as swiglu_mlp
from moejax.models._layers import unembed_logits as unembed_logits
from moejax.models._lm import REMAT_POLICIES as REMAT_POLICIES
from moejax.models._lm import LMAux as LMAux
from moejax.models._lm import cast_floating as cast_floating
from moejax.models._lm import lm_forward as lm_forward
from moejax.models._lm import merge_rows as merge_rows
from moejax.models._lm import merge_stats as merge_stats
from moejax.models._lm import moe_layer_inputs as moe_layer_inputs
from moejax.models._lm import remat_policy as remat_policy
from moejax.models._lm import split_rows as split_rows
from moejax.models._lm_params import ParamCounts as ParamCounts
from moejax.models._lm_params import abstract_params as abstract_params
from moejax.models._lm_params import init_lm_params as init_lm_params
from moejax.models._lm_params import param_counts as param_counts
from moejax.models._mla import MLAConfig as MLAConfig
from moejax.models._patterns import mlp_layer_types_of as mlp_layer_types_of
from moejax.models._sharding import check_lm_mesh as check_lm_mesh
from moejax.models._sharding import lm_compute_specs as lm_compute_specs
from moejax.models._sharding import lm_logical_axes as lm_logical_axes
from moejax.models._sharding import lm_mesh_problems as lm_mesh_problems
from moejax.models._sharding import lm_partition_specs as lm_partition_specs
from moejax.models._upcycle import dense_lm_config as dense_lm_config
from moejax.models._upcycle import upcycle as upcycle

__all__ = [
    "REMAT_POLICIES",
    "LMAux",
    "LMConfig",
    "MLAConfig",
    "RopeScaling",
    "ParamCounts",
    "abstract_params",
    "apply_rope",
    "attention",
    "cast_floating",
    "causal_attention",
    "check_lm_mesh",
    "dense_lm_config",
    "generate",
    "init_lm_params",
    "lm_compute_specs",
    "lm_forward",
    "lm_logical_axes",
    "lm_mesh_problems",
    "merge_rows",
    "merge_stats",
    "mlp_layer_types_of",
    "moe_layer_inputs",
    "lm_partition_specs",
    "param_counts",
    "presets",
    "remat_policy",
    "rms_norm",
    "rope_frequencies",
    "rope_tables",
    "split_rows",
    "swiglu_mlp",
    "unembed_logits",
    "upcycle",
]
