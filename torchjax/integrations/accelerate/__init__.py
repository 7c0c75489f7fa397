"""accelerate glue: ``Accelerator()`` and ``PartialState()`` pick "tpu" when it is torch's
accelerator (Note [accelerate's device on tpu], ``_device.py``). Installed by ``import
torchjax`` once accelerate is imported; importing this package does not import accelerate.
"""
