"""Multi-token prediction (DeepSeek-V3, section 2.2 of its report): extra blocks that predict
tokens further ahead, for training.

Block `k` of `M` (`LMConfig.mtp_layers`, 1-based) at position `i`:

```
z_i  = [rms_norm(Emb(t_{i+k}), enorm); rms_norm(h_i^{k-1}, hnorm)] W_eh       [2D] -> [D]
h^k  = Block_k(z)                            (a transformer block, causal over i)
P^k_i = softmax(rms_norm(h^k_i, norm) W_unembed)        predicts t_{i+k+1}
```

`h^{k-1}` is, with `LMConfig.mtp_input="final_norm"` (the default), the main model's final-normed
hidden state for `k = 1` (what its unembedding reads) and block `k - 1`'s normed output
`rms_norm(h^{k-1}, norm)` after, the states vLLM, SGLang, Megatron-Core and transformers'
`MtpModel` pass a draft block; with `"pre_norm"`, the raw states before those norms (MaxText).
`Emb` and `W_unembed` are the main model's (shared). The embedding comes first in the
concatenation, as DeepSeek's released code and checkpoints (`eh_proj` reads `[enorm(emb),
hnorm(h)]`). The training loss adds `mtp_loss_weight` times the mean over blocks of their
cross-entropies (`moejax.training.lm_loss`). The blocks' MoE layers are outside `LMAux` (their
routing statistics are not reported, their experts are not re-placed) and generation skips the
blocks.

Parameters: `params["mtp"][k - 1]` = `{"enorm", "hnorm": {"scale": [D]}, "eh_proj": {"kernel":
[2D, D]}, "block": one layer's tree, "norm": {"scale": [D]}}`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.models._layers import rms_norm, unembed_logits


def mtp_inputs(tokens: jax.Array, seq_len: int, depth: int) -> jax.Array:
    """Token ids `[B, S]` whose embeddings block `depth` (1-based) reads: `tokens[:, depth :
    depth + S]` of `tokens [B, S + j]` (the inputs and at least their next token), zero past
    the end (those positions predict nothing)."""
    b, n = tokens.shape
    window = tokens[:, depth : depth + seq_len]
    return jnp.pad(window, ((0, 0), (0, seq_len - window.shape[1])))


def main_state(h: jax.Array, x: jax.Array, cfg) -> jax.Array:
    """The main model's state block 1 reads (`cfg.mtp_input`): `x = final_norm(h)` or `h`, the
    last block's output (both `[B, S, D]`)."""
    return x if cfg.mtp_input == "final_norm" else h


def mtp_logits(p, h, tokens, embedding, unembed, cfg, block) -> jax.Array:
    """`[M, B, S, V]` fp32 logits of every MTP block (module docstring).

    Args:
      p: `params["mtp"]` (cast to the compute dtype).
      h: `[B, S, D]` the main model's hidden state `cfg.mtp_input` names: its final norm's
        output (`"final_norm"`) or the last block's (`"pre_norm"`).
      tokens: `[B, S + j]` ids, `j >= 1` (`mtp_inputs`).
      embedding: `[V, D]`; unembed: `[D, V]`.
      cfg: the model config.
      block: `block(layer, x) -> x`, one transformer block over `[B, S, D]`.
    """
    out = []
    s = h.shape[1]
    for k, layer in enumerate(p, start=1):
        e = jnp.take(embedding, mtp_inputs(tokens, s, k), axis=0)
        e = rms_norm(e, layer["enorm"]["scale"], cfg.norm_eps)
        hh = rms_norm(h, layer["hnorm"]["scale"], cfg.norm_eps)
        z = jnp.concatenate([e, hh], axis=-1) @ layer["eh_proj"]["kernel"]
        y = block(layer["block"], z)
        x = rms_norm(y, layer["norm"]["scale"], cfg.norm_eps)
        out.append(unembed_logits(x, unembed))
        h = x if cfg.mtp_input == "final_norm" else y
    return jnp.stack(out)


def mtp_cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """`[M]` mean cross-entropy of each block's predictions: block `k`'s position `i` against
    `tokens[:, i + k + 1]`, over the positions where that token exists.

    Args:
      logits: `[M, B, S, V]` from `mtp_logits`.
      tokens: `[B, S + j]`, the ids given to `mtp_logits`.
    """
    import optax

    m, _, s, _ = logits.shape
    out = []
    for k in range(1, m + 1):
        targets = mtp_inputs(tokens, s, k + 1)
        valid = (jnp.arange(s) + k + 1 < tokens.shape[1]).astype(jnp.float32)  # [S]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[k - 1], targets)
        out.append(jnp.sum(ce * valid) / (jnp.maximum(valid.sum(), 1) * ce.shape[0]))
    return jnp.stack(out)
