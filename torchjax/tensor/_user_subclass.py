"""A user's ``torch.Tensor`` subclass on tpu.

Note [User tensor subclasses on tpu]
``MyTensor(...).to("tpu")`` keeps the class on CUDA: torch's default
``__torch_function__`` turns every result into ``MyTensor`` with ``as_subclass``, an
alias of the result wrapped in the class. A tpu result is already a Python object (a
JaxTensor, the device's wrapper), so torch's ``as_subclass`` refuses to wrap it again.
A tpu tensor of a user's class is instead an instance of a class made once per user
class, ``(MyTensor, JaxTensor)``: ``isinstance(t, MyTensor)`` holds, the user's methods
and attributes work, ops run as on any tpu tensor. It is made by giving an autograd
alias of the JaxTensor that class, so it shares the data and the graph, as
``as_subclass`` does.

Only plain subclasses take this form: a class with its own ``__torch_dispatch__`` (a
wrapper subclass of its own) or ``nn.Parameter`` keeps torch's behaviour. Results
convert as torch's default ``__torch_function__`` converts them: tpu results to the made
class, results on other devices (a ``.cpu()``) to the user's class. The made class puts
that conversion after the user's class in its MRO, so a user ``__torch_function__`` that
calls ``super()`` gets it too (JaxTensor's own is torch's disabled one). ``type(t)`` is
the made class (same name and module), not the user's class itself; pickling rebuilds
through the user's class, deep copies keep the made class.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import disable_torch_function_subclass
from torchjax.tensor._tensor import JaxTensor

_MADE: dict = {}


def _plain(cls) -> bool:
    return (
        isinstance(cls, type)
        and issubclass(cls, torch.Tensor)
        and not issubclass(cls, (JaxTensor, torch.nn.Parameter))
        and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )


def user_class(cls):
    """The user's class of a made class, or None."""
    return cls.__dict__.get("_torchjax_user_class")


def tpu_class(cls):
    """The class a tpu tensor of ``cls`` has (Note above), or None if ``cls`` keeps
    torch's ``as_subclass``."""
    if user_class(cls) is not None:
        return cls
    if not _plain(cls):
        return None
    made = _MADE.get(cls)
    if made is None:
        ns = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_torchjax_user_class": cls,
        }
        made = type(cls.__name__, (cls, _Converting), ns)
        if made.__basicsize__ != JaxTensor.__basicsize__:  # __slots__: another layout
            raise TypeError(
                f"torchjax: a tpu tensor cannot be of the tensor subclass {cls.__qualname__}: "
                "its __slots__ change the object layout the tpu tensor has; move a plain "
                "tensor to tpu instead, or drop the __slots__"
            )
        _MADE[cls] = made
    return made


def alias_as(t: JaxTensor, made):
    """An autograd alias of ``t`` whose class is ``made``."""
    with disable_torch_function_subclass():
        out = torch.ops.aten.alias.default(t)
    out.__class__ = made
    return out


def _convert(ret, cls):
    if isinstance(ret, torch.Tensor):
        if isinstance(ret, cls):
            return ret
        if isinstance(ret, JaxTensor):
            return alias_as(ret, cls)
        user = user_class(cls)
        return ret if isinstance(ret, user) else ret.as_subclass(user)
    if isinstance(ret, (tuple, list)):
        return type(ret)(_convert(r, cls) for r in ret)
    return ret


class _Converting(JaxTensor):
    """The base of every made class, after the user's class in its MRO: a user
    ``__torch_function__`` calling ``super()`` reaches this one, not JaxTensor's
    disabled one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.Tensor.__torch_function__ (torch/_tensor.py), converting per device.
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented
        with disable_torch_function_subclass():
            ret = func(*args, **(kwargs or {}))
            if func in torch.overrides.get_default_nowrap_functions():
                return ret
            return _convert(ret, cls)
