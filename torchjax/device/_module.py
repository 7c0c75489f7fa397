"""``torch.tpu``: what ``torch.cuda`` users reach for, backed by JAX.

Device indices are positions in ``jax.devices()``: on a TPU host they are the chips, on
a GPU host the GPUs, on a plain machine the CPU device(s) JAX runs on.
"""

from __future__ import annotations

import contextlib

import jax
import torch

from torchjax._compat.torch import seeding_all_generators
from torchjax.device import _checks, _fork
from torchjax.tensor import _storage
from torchjax.tensor import random as _random


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, got {device}")
    return 0 if device.index is None else device.index


def jax_device(index: int):
    """The jax device behind tpu:``index``; RuntimeError for an invalid ordinal."""
    if _fork.FORKED[0]:  # Note [tpu tensors after fork]
        raise _fork.error("cannot make a tpu tensor")
    devices = jax.devices()
    if not 0 <= index < len(devices):
        raise RuntimeError(
            f"torchjax: invalid device ordinal tpu:{index}: JAX sees {len(devices)} "
            f"device(s) ({devices[0].platform}), so valid devices are tpu:0..tpu:{len(devices) - 1}"
        )
    return devices[index]


def is_available() -> bool:
    """True: JAX always has at least one device (CPU when there is no accelerator)."""
    return True


# torch.utils.checkpoint stashes a device's RNG state for the recomputation only when
# its module says it is initialised (``getattr(torch.cuda, "_initialized", False)``, so as
# not to start CUDA by accident); without it the recomputed dropout draws a new mask and
# the gradients are wrong. JAX needs no start-up, so the tpu module is always initialised.
_initialized = True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """Number of JAX devices (``len(jax.devices())``)."""
    return jax.device_count()


def current_device() -> int:
    return 0


def set_device(device) -> None:
    if _index(device) != 0:
        raise NotImplementedError(
            "torchjax: only tpu:0 can be the current device; place arrays on other devices "
            "with a mesh (torchjax.mesh) or an explicit device index"
        )


@contextlib.contextmanager
def device(device):
    set_device(device)
    yield


def get_device_name(device=None) -> str:
    return str(jax_device(_index(device)).device_kind)


def synchronize(device=None) -> None:
    """Block until every pending JAX computation has finished (all live arrays ready);
    then raise the first failed device check, if any (Note [Device-side checks])."""
    for hook in _checks.BEFORE_SYNC:  # recorded ops run first (Note [Fused eager])
        hook()
    jax.block_until_ready(jax.live_arrays())
    _checks.raise_pending()


def set_sync_checks(enabled: bool) -> None:
    """Immediate mode for device checks (index range, integer division by zero): raise
    at the op (one host read per checked op) instead of at the next synchronisation
    point; ``TORCHJAX_SYNC_CHECKS=1`` sets it for a process (Note [Device-side checks])."""
    _checks.set_sync_checks(enabled)


# -- RNG (signatures match torch.cuda's, which torch.random.fork_rng calls) -------------


def manual_seed(seed: int) -> None:
    """Seed the RNG of the current tpu device."""
    _random.manual_seed(seed, current_device())


def manual_seed_all(seed: int) -> None:
    """Seed the RNG of every tpu device (called by ``torch.manual_seed``)."""
    # Inside a trace, whether CPU's generator is seeded too (Note [CPU generators a
    # trace moves] in torchjax/compile/_host_rng.py).
    host = _random.traced_stream() is not None and seeding_all_generators()
    for i in range(device_count()):
        _random.manual_seed(seed, i, host=host)


def seed() -> None:
    import random

    _refuse_random_seed("seed")
    manual_seed(random.getrandbits(63))


def seed_all() -> None:
    import random

    _refuse_random_seed("seed_all")
    manual_seed_all(random.getrandbits(63))


def _refuse_random_seed(name: str) -> None:
    # A seed drawn inside a trace would be a constant of the program, repeated by every
    # call (Note [Seeds set inside a trace] in torchjax/tensor/random.py).
    if _random.traced_stream() is not None:
        raise RuntimeError(
            f"torch.tpu.{name}() inside torchjax.jit: the random seed it picks would be a "
            "constant of the compiled program, the same on every call. Call it outside "
            "the jitted function, or use torch.seed(), which makes every call trace anew."
        )


def initial_seed() -> int:
    return _random.initial_seed(current_device())


def get_rng_state(device="tpu") -> torch.Tensor:
    """The RNG state of ``device`` as a CPU uint8 tensor."""
    return _random.get_state(_index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [_random.get_state(i) for i in range(device_count())]


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    """Restore a state returned by ``get_rng_state``."""
    _random.set_state(new_state, _index(device))


def set_rng_state_all(new_states) -> None:
    for i, st in enumerate(new_states):
        _random.set_state(st, i)


# -- AMP ---------------------------------------------------------------------------------


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes ``torch.autocast("tpu", dtype=...)`` accepts."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# -- memory --------------------------------------------------------------------------------


def memory_stats(device=None) -> dict:
    """JAX's ``Device.memory_stats()`` (TPU/GPU). On CPU JAX reports none and
    ``bytes_in_use`` is summed over live jax arrays on that device. ``bytes_unfilled``
    adds the new tensors whose array is made on first read (Note [Storages filled on
    first read] in torchjax/tensor/_storage.py)."""
    dev = jax_device(_index(device))
    stats = dict(dev.memory_stats() or {})
    if "bytes_in_use" not in stats:
        in_use = 0
        for a in jax.live_arrays():
            if dev in a.devices():
                in_use += a.nbytes // max(len(a.devices()), 1)
        stats["bytes_in_use"] = in_use
    stats["bytes_unfilled"] = _storage.unfilled_bytes(dev)
    return stats


def memory_allocated(device=None) -> int:
    """Bytes held by tensors on ``device``: its arrays, and the new tensors whose array
    is made on first read (counted from their creation, as CUDA counts them)."""
    return _allocated(memory_stats(device))


def _allocated(stats: dict) -> int:
    return int(stats["bytes_in_use"]) + int(stats["bytes_unfilled"])


def max_memory_allocated(device=None) -> int:
    """Peak bytes in use, where JAX reports it (TPU/GPU); else the current figure."""
    stats = memory_stats(device)
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return _allocated(stats)


def memory_reserved(device=None) -> int:
    stats = memory_stats(device)
    return int(stats.get("bytes_reserved", stats.get("bytes_limit", stats.get("bytes_in_use", 0))))


def empty_cache() -> None:
    """No-op: XLA's allocator frees device buffers when jax arrays die."""


def reset_peak_memory_stats(device=None) -> None:
    """No-op: JAX exposes no way to reset its peak counter (``peak_bytes_in_use``)."""


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes where JAX reports a limit (TPU/GPU); on CPU, (0, 0) is
    not meaningful, so total is the host's physical memory and free what is not in use."""
    stats = memory_stats(device)
    total = stats.get("bytes_limit")
    if total is None:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total) - int(stats.get("bytes_in_use", 0)), int(total)


class _DeviceProperties:
    """What ``torch.cuda.get_device_properties`` users read: name, total_memory."""

    def __init__(self, index: int):
        dev = jax_device(index)
        self.name = str(dev.device_kind)
        self.platform = dev.platform
        self.total_memory = mem_get_info(index)[1]

    def __repr__(self):
        return (
            f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
            f"total_memory={self.total_memory // 2**20}MB)"
        )


def get_device_properties(device=None) -> _DeviceProperties:
    return _DeviceProperties(_index(device))


def init() -> None:
    """No-op: JAX initialises its backends on first use."""
