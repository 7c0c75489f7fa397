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


_HOOKS_NAME = "torch.optim global optimizer step hooks"


def set_step_hooks(pre, post) -> None:
    """Register ``pre`` and ``post`` as torch.optim's global optimizer step pre- and
    post-hooks (``register_optimizer_step_pre_hook``: called as ``hook(optimizer, args,
    kwargs)`` around every ``Optimizer.step``, in registration order), recorded while in
    force (Note [Process-wide changes]); ``pre=None`` removes them. Written for torch 2.13,
    whose ``Optimizer.profile_hook_step`` runs the global pre-hooks before an optimizer's
    own and its global post-hooks after an optimizer's own."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from torchjax import _patches

    if pre is None:
        if _patches.is_recorded(_HOOKS_NAME):
            _patches.undo(_HOOKS_NAME)
        return
    if _patches.is_recorded(_HOOKS_NAME):
        return
    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def undo():
        for h in handles:
            h.remove()

    _patches.record(
        _HOOKS_NAME,
        why="in fused eager mode a repeated optimizer step on tpu parameters runs as one "
        "captured program (Note [Captured optimizer steps])",
        package="torch",
        written_for="2.13",
        undo=undo,
    )
