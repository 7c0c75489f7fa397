"""What an overload's schema says, read once per overload: its out= arguments, whether
it is in-place or a view, and the functional overload an in-place or out= one derives
from."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def arg(args, kwargs, i: int, name: str, default=None):
    """Argument ``i`` (keyword ``name``) of a call as a handler or precheck gets it."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def out_names(schema) -> list[str]:
    return [
        a.name
        for a in schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]


def is_inplace(schema) -> bool:
    args = schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def is_view(schema) -> bool:
    if not schema.returns or is_inplace(schema):
        return False
    ai = schema.returns[0].alias_info
    return ai is not None and not ai.is_write


def functional_sibling(func):
    """The functional overload an in-place/out= overload derives from, or None."""
    schema = func._schema
    outs = out_names(schema)
    if not outs and not is_inplace(schema):
        return None
    name = func._opname
    if not outs:
        if not name.endswith("_"):
            return None
        name = name[:-1]
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
    if not outs:
        want[0] = (want[0][0], "Tensor")
    for ov_name in packet.overloads():
        ov = getattr(packet, ov_name)
        if ov is func or out_names(ov._schema) or is_inplace(ov._schema):
            continue
        got = [(a.name, str(a.type)) for a in ov._schema.arguments]
        if got == want:
            return ov
    return None


def is_inplace_view(func, sibling) -> bool:
    """``t_``, ``unsqueeze_``, ``as_strided_``...: in-place ops that change metadata."""
    return is_view(sibling._schema)
