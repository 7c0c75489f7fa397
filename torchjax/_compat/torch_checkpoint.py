"""Private PyTorch API of activation checkpointing's recomputation (part of
torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

import functools
import inspect

import torch
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


def checkpoint_region():
    """``(frame, recomputing, group)`` of the torch.utils.checkpoint region whose
    saved-tensor hooks are this thread's innermost: its ``_CheckpointFrame``, False and
    None while its non-reentrant forward runs, True and the backward's group id while it
    is recomputed; None outside such a region. The hooks are seen through a wrapper that
    keeps the original as ``pack_hook`` (tensor/_backward_errors.py). Private:
    ``torch._C._autograd._top_saved_tensors_default_hooks`` and the names and closure
    variables of ``_checkpoint_hook``'s and ``_recomputation_hook``'s pack hooks (torch
    2.13)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return None
    pack = top[0]
    pack = getattr(getattr(pack, "__self__", None), "pack_hook", pack)
    pack = inspect.unwrap(pack)  # the recomputation's is wrapped by torch._dynamo.disable
    code = getattr(pack, "__code__", None)
    if getattr(pack, "__module__", None) != _checkpoint.__name__ or code is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in pack.__closure__ or ())))
    name = pack.__qualname__
    if name.startswith("_checkpoint_hook.") and "frame" in cells:
        return cells["frame"], False, None
    if name.startswith("_recomputation_hook.") and "target_frame_ref" in cells:
        frame = cells["target_frame_ref"]()
        return (frame, True, cells.get("gid")) if frame is not None else None
    return None
