"""accelerate glue, installed by ``import torchjax`` once accelerate is imported
(importing this package does not import accelerate):

- ``Accelerator()`` / ``PartialState()`` pick "tpu" when it is torch's accelerator, and
  ``device_map="auto"`` offers the tpu devices (``_device.py``, Note [accelerate's device
  on tpu]);
- ``save_state`` / ``load_state`` of tpu models, tied weights and the tpu RNG included
  (``_saving.py``);
- disk-offloaded weights read back for a tpu execution device (``_offload.py``).
"""
