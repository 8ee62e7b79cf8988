"""Integrations with other libraries.

* :mod:`relbias.integrations.loading`: T5-family bias tables as :class:`relbias.T5Bias` modules, from a Hugging Face
  model, a state dict or a ``.safetensors`` file (needs no transformers).
* :mod:`relbias.integrations.transformers`: ``patch`` / ``unpatch``, the front door for transformers models computing
  their attention with relbias backends (needs ``transformers``, the ``hf`` extra; imported on use). It dispatches to
  one module per family: :mod:`~relbias.integrations.t5` (T5, mT5, UMT5, Switch Transformers, Pop2Piano),
  :mod:`~relbias.integrations.longt5`, :mod:`~relbias.integrations.mpnet`, :mod:`~relbias.integrations.alibi_decoders`
  (BLOOM, MPT, Falcon), which import the shared helpers (:mod:`~relbias.integrations.common`, ``t5_attention``,
  ``alibi_common``, ``masks``, ``hidden_rows``, ``loading``) and never the front door.
"""

from .loading import T5Biases, t5_biases_from_model, t5_biases_from_safetensors, t5_biases_from_state_dict

__all__ = ["T5Biases", "t5_biases_from_model", "t5_biases_from_safetensors", "t5_biases_from_state_dict"]
