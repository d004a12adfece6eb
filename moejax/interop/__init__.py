"""Interoperability with other frameworks' checkpoints.

- `moejax.interop.hf`: Hugging Face MoE blocks (safetensors tensors and `config.json`) to and from
  moejax layer parameters and `MoEConfig`.
"""

from moejax.interop import hf as hf

__all__ = ["hf"]
