"""The "tpu" device: PrivateUse1 registration, the ``torch.tpu`` module, factory kernels."""

from torchjax.device import _registration as _registration  # noqa: F401  (registers)
from torchjax.device._module import (
    current_device,
    device_count,
    get_amp_supported_dtype,
    get_rng_state,
    is_available,
    manual_seed,
    manual_seed_all,
    set_rng_state,
    synchronize,
)

__all__ = [
    "current_device",
    "device_count",
    "get_amp_supported_dtype",
    "get_rng_state",
    "is_available",
    "manual_seed",
    "manual_seed_all",
    "set_rng_state",
    "synchronize",
]
