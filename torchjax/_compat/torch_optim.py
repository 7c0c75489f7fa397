"""Private PyTorch API of torch.optim's choice of implementation (part of torchjax/_compat,
split from torch.py by subject)."""

from __future__ import annotations

_NAME = "torch foreach tensor types"


def foreach_type_lists() -> tuple[list, list]:
    """The two lists torch 2.13 reads ``type(t)`` against before taking a foreach path:
    ``torch.optim.optimizer._foreach_supported_types`` (``Tensor``, ``Parameter``;
    ``_default_to_fused_or_foreach``, which every optimizer's ``foreach=None`` asks) and
    ``torch.utils._foreach_utils._foreach_supported_types`` (``Tensor``;
    ``_has_foreach_support``, which ``clip_grad_norm_``, ``clip_grads_with_norm_``,
    ``get_total_norm`` and ``clip_grad_value_`` ask)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    return optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types


def install_foreach_type(cls, why: str) -> None:
    """Add ``cls`` to both lists of ``foreach_type_lists`` (as torch's own DTensor adds itself,
    torch/distributed/tensor/__init__.py), recorded (Note [Process-wide changes]); undone
    by taking it out of the lists it was added to."""
    from torchjax import _patches

    if _patches.is_recorded(_NAME):
        return
    added = [types for types in foreach_type_lists() if cls not in types]
    for types in added:
        types.append(cls)

    def undo():
        for types in added:
            if cls in types:
                types.remove(cls)

    _patches.record(_NAME, why=why, package="torch", written_for="2.13", undo=undo)
