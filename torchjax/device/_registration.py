"""Makes "tpu" a real torch device (PrivateUse1), from pure Python, on import.

All use of torch's private Python-backend helper goes through torchjax/_compat/torch.py.
After this runs, ``torch.device("tpu")``, ``x.to("tpu")``, ``module.to("tpu")`` and
``torch.zeros(3, device="tpu")`` work with no mode switched on: factory calls reach the
PrivateUse1 kernels in ``_factory``, and everything else reaches JaxTensor's
``__torch_dispatch__``. Nothing here is thread-local (transformers copies weights to the
device from worker threads).
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import (
    DeviceGuard,
    install_module_moves,
    install_swap_tensors,
    privateuse1_backend_name,
    setup_privateuse1_python_backend,
)
from torchjax.device import (
    _accelerator,
    _autocast,
    _dataloader,
    _engine_queues,
    _factory,
    _fork,
    _layouts,
    _module,
    _optim_foreach,
    _pinned,
    _serialization,
)
from torchjax.tensor import _backward_errors, _grad_devices

DEVICE_TYPE = "tpu"


def _register() -> None:
    current = privateuse1_backend_name()
    owner = getattr(torch, DEVICE_TYPE, None)
    if current == DEVICE_TYPE and owner is _module:
        return  # already registered (module re-imported)
    if current == DEVICE_TYPE:
        # Note [Another "tpu" backend]: the torch-tpu package (PyTorch's native TPU
        # backend) registers the same name at its import, or at `import torch` through
        # torch's backend autoloading; one process holds one PrivateUse1 backend.
        name = getattr(owner, "__name__", None) or "another library"
        raise RuntimeError(
            f"torchjax: the 'tpu' device is already registered by {name} (the torch-tpu "
            "package, PyTorch's native TPU backend, registers it too), and a process can "
            "hold only one such backend. To use torchjax, uninstall torch-tpu "
            "(pip uninstall torch-tpu), or keep it from loading at `import torch` with "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 and do not import it beside torchjax."
        )
    if current != "privateuseone":
        raise RuntimeError(
            f"torchjax: the PrivateUse1 backend is already registered as {current!r} by "
            "another library; torchjax needs it for the 'tpu' device. Import only one "
            "PrivateUse1 backend per process."
        )
    setup_privateuse1_python_backend(DEVICE_TYPE, _module, DeviceGuard())
    _factory.register_kernels()
    _autocast.register()
    _pinned.register()
    _layouts.register()
    _dataloader.register()
    _fork.register()
    _serialization.register()
    _accelerator.register()
    _optim_foreach.register()
    _backward_errors.install_saved_hooks_guard()
    _grad_devices.install()
    _engine_queues.register()
    install_swap_tensors(_involves_tpu)
    install_module_moves(_holds_tpu_params)


def _involves_tpu(t1, t2) -> bool:
    # Note [Moving modules with live references] in torchjax/_compat/torch.py.
    from torchjax.tensor._tensor import JaxTensor

    return isinstance(t1, JaxTensor) or isinstance(t2, JaxTensor)


def _holds_tpu_params(module) -> bool:
    # Note [Moving modules off tpu] in torchjax/_compat/torch.py: the module's own
    # parameters (``_apply`` recurses into its children itself).
    from torchjax.tensor._tensor import JaxTensor

    return any(isinstance(p, JaxTensor) for p in module._parameters.values())


_register()
