"""``torch.Generator(device="tpu")``.

Note [tpu generators]
torch makes a device generator through the backend's C++
``PrivateUse1HooksInterface::getNewGenerator``, which a Python backend cannot provide:
``torch.Generator(device="tpu")`` raised NotImplementedError from C++. Libraries write
exactly that: diffusers' documentation seeds every pipeline call with
``torch.Generator(device).manual_seed(0)``, for the device the pipeline runs on.

``torch.Generator`` becomes a subclass of torch's generator type with the same signature.
For a tpu device it makes a CPU generator that reports ``device`` ``tpu:<index>``;
every other device is torch's constructor unchanged. A tpu random op given such a
generator draws on CPU from it and moves the values (Note [CPU generators on tpu] in
ops/random.py), so a seeded tpu generator gives the values a CPU generator with that
seed gives: a pipeline seeded on tpu reproduces its CPU image. ``manual_seed``,
``seed``, ``initial_seed``, ``get_state``/``set_state`` are the CPU generator's; copies
and pickles stay tpu generators. Generators torch makes itself (``torch.default_generator``)
are still instances of ``torch.Generator``: the class's ``isinstance`` and ``issubclass``
answer for torch's generator type. One difference from a CUDA generator: a CPU op given
a tpu generator draws from it, where torch refuses a generator of another device.
"""

from __future__ import annotations

import torch

from torchjax import _patches
from torchjax.device import _module

_NAME = "torch.Generator"
_BASE = torch._C.Generator


class _GeneratorType(type(_BASE)):
    # torch's own generators (torch.default_generator, a CUDA generator) are instances
    # of the C type, not of this subclass: they must still pass isinstance(g,
    # torch.Generator).
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _BASE)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _BASE)


class Generator(_BASE, metaclass=_GeneratorType):
    """``torch.Generator``, which also makes generators for tpu (Note [tpu generators])."""

    def __new__(cls, device="cpu"):
        dev = torch.device(device)
        if dev.type != "tpu":
            return super().__new__(cls, device)
        gen = super().__new__(cls, "cpu")
        gen._tpu_device = torch.device(
            "tpu", _module.current_device() if dev.index is None else dev.index
        )
        return gen

    @property
    def device(self) -> torch.device:
        tpu = self.__dict__.get("_tpu_device")
        return tpu if tpu is not None else _BASE.device.__get__(self)

    def __reduce__(self):
        tpu = self.__dict__.get("_tpu_device")
        if tpu is None:
            return super().__reduce__()
        return (_rebuild_tpu, (str(tpu), self.get_state()))

    def __deepcopy__(self, memo):
        tpu = self.__dict__.get("_tpu_device")
        if tpu is None:  # torch's generator type copies through __reduce__
            rebuild, args, *state = super().__reduce__()
            gen = rebuild(*args)
            if state and state[0] is not None:
                gen.__setstate__(state[0])
            return gen
        return _rebuild_tpu(str(tpu), self.get_state())


Generator.__module__ = "torch"
Generator.__qualname__ = Generator.__name__ = "Generator"


def _rebuild_tpu(device: str, state: torch.Tensor):
    gen = Generator(device)
    gen.set_state(state)
    return gen


def register() -> None:
    """Make ``torch.Generator`` this class (recorded; idempotent)."""
    if _patches.is_recorded(_NAME):
        return
    _patches.replace_attr(
        torch,
        "Generator",
        Generator,
        name=_NAME,
        why="torch.Generator(device='tpu') makes a CPU generator reporting tpu instead of "
        "raising NotImplementedError from C++",
        package="torch",
        written_for="2.13",
    )
