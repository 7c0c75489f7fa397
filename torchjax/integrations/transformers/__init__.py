"""transformers glue.

- ``compile_generate(model)`` makes ``model.generate(..., cache_implementation="static")``
  run its prefill and decode step as ``torchjax.jit`` programs (``_generate.py``).
- ``register_experts()`` adds the ragged-dot MoE experts implementation (``_moe.py``).
- ``from_pretrained(..., device_map="tpu")`` reads safetensors straight into jax arrays
  (``_loading.py``, installed by ``import torchjax`` once transformers is imported).

transformers itself is imported lazily: importing this package does not import it.
"""

from torchjax.integrations.transformers._generate import compile_generate as compile_generate
from torchjax.integrations.transformers._moe import register_experts as register_experts

__all__ = ["compile_generate", "register_experts"]
