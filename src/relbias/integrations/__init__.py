"""Integrations with other libraries.

* :mod:`relbias.integrations.loading`: T5-family bias tables as :class:`relbias.T5Bias` modules, from a Hugging Face
  model, a state dict or a ``.safetensors`` file (needs no transformers).
* :mod:`relbias.integrations.transformers`: ``patch_t5`` / ``unpatch_t5``, T5, mT5 and UMT5 models computing their
  self-attention with relbias backends (needs ``transformers``, the ``hf`` extra; imported on use).
"""

from .loading import T5Biases, t5_biases_from_model, t5_biases_from_safetensors, t5_biases_from_state_dict

__all__ = ["T5Biases", "t5_biases_from_model", "t5_biases_from_safetensors", "t5_biases_from_state_dict"]
