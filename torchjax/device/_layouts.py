"""Nested tensors on tpu: refused when made, with a message saying what to do instead.

Note [Unsupported layouts]
A tpu tensor is one jax array with torch's strided layout. torch builds a nested tensor
(``torch.nested``) around a buffer of any device without asking the backend, so
``torch.nested.nested_tensor(ts, device="tpu")`` used to return an object on which every op
then failed with torch's generic "Could not run ... from the 'NestedTensortpu' backend".
Two registrations refuse it where it is made:

- a fallback kernel for the NestedTensorPrivateUse1 dispatch key: every op on a nested
  tensor whose buffer is on tpu (``nt.to("tpu")``, which copies into one, and any op
  afterwards) raises ``unsupported_layout``'s error;
- ``torch.nested.nested_tensor`` and ``torch.nested.as_nested_tensor`` wrapped (same
  signature, same result for every other device): asked for a tpu device, or given tpu
  tensors, they raise the same error before building anything (torch builds a strided
  nested tensor in C++ with no op the fallback would see). The jagged layout's
  constructor (``aten::_nested_view_from_jagged``) refuses in torchjax/ops/long_tail.py.

``nn.TransformerEncoder``'s own packing (``_nested_tensor_from_mask``) is the one nested
tensor made on tpu: a padded stand-in that answers the ops the encoder applies (Note
[TransformerEncoder's nested path on tpu] in torchjax/ops/transformer_nested.py).

Sparse layouts are refused by their constructors' lowerings (torchjax/ops/embedding.py,
torchjax/ops/long_tail.py).
"""

from __future__ import annotations

import functools

import torch

from torchjax import _patches
from torchjax._compat.torch import destroy_library

_LIB = None


def unsupported_layout(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"torchjax: {what}: nested tensors (torch.nested) are not supported on device "
        "'tpu', which holds strided tensors only. Keep the nested tensor on CPU, or pad it "
        "to one dense tensor with a mask (torch.nested.to_padded_tensor(nt, 0.0).to('tpu'), "
        "or torch.nn.utils.rnn.pad_sequence) and move that."
    )


def _fallback(op, *args, **kwargs):
    raise unsupported_layout(f"{op} on a nested tensor")


def _on_tpu(tensors, device) -> bool:
    if device is not None and torch.device(device).type == "tpu":
        return True
    return device is None and any(
        isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in tensors
    )


def _refusing_tpu(original):
    @functools.wraps(original)
    def constructor(ts, *args, **kwargs):
        device = kwargs.get("device")
        if device is None and len(args) >= 2:
            device = args[1]  # (ts, dtype, device, ...) in both constructors
        tensors = ts if isinstance(ts, (list, tuple)) else [ts]
        if _on_tpu(tensors, device):
            raise unsupported_layout(f"torch.nested.{original.__name__}")
        return original(ts, *args, **kwargs)

    return constructor


def _undo() -> None:
    global _LIB
    if _LIB is not None:
        destroy_library(_LIB)
        _LIB = None


def register() -> None:
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("_", "IMPL")
    _LIB.fallback(_fallback, dispatch_key="NestedTensorPrivateUse1")
    _patches.record(
        "NestedTensorPrivateUse1 fallback",
        why="ops on nested tensors with a tpu buffer are refused with torchjax's message",
        package="torch",
        written_for="2.13",
        undo=_undo,
    )
    for name in ("nested_tensor", "as_nested_tensor"):
        _patches.replace_attr(
            torch.nested,
            name,
            _refusing_tpu(getattr(torch.nested, name)),
            name=f"torch.nested.{name}",
            why="a nested tensor on tpu is refused when made, not at its first op",
            package="torch",
            written_for="2.13",
        )
