"""accelerate's ``DynamoBackend`` accepts "tpu".

Note [accelerate's Dynamo backend names]
``TrainingArguments(torch_compile=True, torch_compile_backend="tpu")`` and
``Accelerator(dynamo_backend="tpu")`` hand the name to accelerate's ``DynamoPlugin``,
which looks it up in its ``DynamoBackend`` enum (``DynamoBackend("TPU")``) and later
passes ``backend=<value>.lower()`` to ``torch.compile``. The enum lists the backends
accelerate knew of when it was released, so "tpu" (torchjax's ``torch.compile`` backend,
registered through its entry point) raised ``ValueError: 'TPU' is not a valid
DynamoBackend``. The enum's ``_missing_`` hook, which ``Enum`` calls for a value it does
not hold, answers one extra member for "TPU" (made once, as ``enum.Flag`` makes its
composite members); every other value gets accelerate's answer, and the enum's listed
members do not change.
"""

from __future__ import annotations

import sys

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "1.16"
_TARGET_MODULE = "accelerate.utils.dataclasses"
_NAME = "accelerate DynamoBackend._missing_"
_VALUE = "TPU"
_MEMBER: dict[type, object] = {}


def _member(cls):
    member = _MEMBER.get(cls)
    if member is None:
        member = str.__new__(cls, _VALUE)
        member._name_ = _VALUE
        member._value_ = _VALUE
        _MEMBER[cls] = member
    return member


def _wrap_missing(original):
    def _missing_(cls, value):
        if isinstance(value, str) and value.upper() == _VALUE:
            return _member(cls)
        return original.__func__(cls, value)

    return classmethod(_missing_)


def install() -> None:
    """Give ``DynamoBackend`` its "TPU" value (Note [accelerate's Dynamo backend names])."""
    if _patches.is_recorded(_NAME):
        return
    cls = sys.modules[_TARGET_MODULE].DynamoBackend
    original = cls._missing_  # Enum's own, bound to the class (a classmethod)
    _patches.replace_attr(
        cls,
        "_missing_",
        _wrap_missing(original),
        name=_NAME,
        why="torch_compile_backend='tpu' / dynamo_backend='tpu' name torchjax's backend",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if accelerate's dataclasses module is loaded, else right after."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="let accelerate's DynamoBackend take 'tpu' right after the module is imported",
    )
