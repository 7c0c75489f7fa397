"""Glue for the Hugging Face libraries (transformers, diffusers, accelerate, kernels) where any
is needed.

Most of the ecosystem needs none: ``"tpu"`` is an ordinary torch device, so
``model.to("tpu")``, ``from_pretrained(..., device_map="tpu")`` and ``pipe.to("tpu")``
work as for any device. The subpackages add what cannot come from that alone
(compiled generation, fast checkpoint loading, the Kernels Hub backend). They import their
library lazily: ``import torchjax`` never imports transformers, diffusers, accelerate or
kernels.
"""
