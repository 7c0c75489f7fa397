"""Private PyTorch API of activation checkpointing's recomputation (part of
torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

import functools

import torch.utils.checkpoint as _checkpoint


def install_recompute_inputs(barrier) -> None:
    """Pass the inputs that ``torch.utils.checkpoint`` recomputes a region from through
    ``barrier`` (a list of values in, a list of the same length out).

    torch 2.13 reads them in two places: the non-reentrant checkpoint through
    ``_CheckpointFrame.get_inputs`` (the saved inputs, unpacked), the reentrant one
    through the module function ``detach_variable`` (the saved inputs, detached, each
    with its ``requires_grad``), which ``CheckpointFunction.backward`` calls by its
    global name. Both are replaced (Note [Process-wide changes], undone by
    ``torchjax.uninstall()``)."""
    from torchjax import _patches

    if _patches.is_recorded("torch.utils.checkpoint.detach_variable"):
        return
    frame = _checkpoint._CheckpointFrame
    get_inputs = frame.__dict__["get_inputs"]
    detach_variable = _checkpoint.detach_variable

    @functools.wraps(get_inputs)
    def get_inputs_barriered(self):
        return barrier(get_inputs(self), connected=True)

    @functools.wraps(detach_variable)
    def detach_variable_barriered(inputs):
        return tuple(barrier(list(detach_variable(inputs)), connected=False))

    why = "a compiled program recomputes a checkpointed region instead of keeping its activations"
    _patches.replace_attr(
        frame,
        "get_inputs",
        get_inputs_barriered,
        name="torch.utils.checkpoint._CheckpointFrame.get_inputs",
        why=why,
        package="torch",
        written_for="2.13",
    )
    _patches.replace_attr(
        _checkpoint,
        "detach_variable",
        detach_variable_barriered,
        name="torch.utils.checkpoint.detach_variable",
        why=why,
        package="torch",
        written_for="2.13",
    )
