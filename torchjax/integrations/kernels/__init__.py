"""Hugging Face ``kernels`` (the Kernels Hub) glue, installed by ``import torchjax`` once
``kernels`` is imported (importing this package does not import it):

- ``torch.backends.tpu`` exists, so ``kernels`` selects its TPU backend and loads a
  kernel repository's ``torch-tpu`` build variant (``_backend.py``, Note [The Kernels Hub
  backend on tpu]).

docs/huggingface.md says how a Hub kernel author targets torchjax.
"""
