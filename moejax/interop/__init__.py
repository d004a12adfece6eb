"""Interoperability with other frameworks' checkpoints.

- `moejax.interop.hf`: Hugging Face MoE checkpoints (safetensors tensors and `config.json`) to and
  from moejax layer parameters and `MoEConfig`, and whole decoders to and from `moejax.models`.
"""

from moejax.interop import hf as hf

__all__ = ["hf"]
