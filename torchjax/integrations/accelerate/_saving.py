"""``Accelerator.save_state`` / ``load_state`` of a model on tpu (safetensors files).

Note [accelerate's safetensors save of tpu tensors]
``accelerate.utils.other.save(..., safe_serialization=True)`` first dedups shared tensors
with ``clean_state_dict_for_safetensors``, which reads every tensor's storage pointer
(``id_tensor_storage`` -> ``untyped_storage().data_ptr()``); written when a tpu tensor's
storage had no pointer ("Attempted to access the data pointer on an invalid python
storage"; now it has the root's address: Note [torch storages of tpu tensors] in
torchjax/tensor/_addresses.py). The wrapper copies tpu tensors to CPU first, views of
one tpu Storage kept views of one CPU storage (``tpu_state_dict_to_cpu``, as for
transformers' ``save_pretrained``), so accelerate's dedup and ``safetensors`` run as for
a CPU model.

``load_state`` reads the file with ``safetensors.torch.load_model(model, file, device=)``,
which groups the *model's* tensors by storage pointer to know which names a tied weight
was saved under: the same failure then. For a model holding tpu tensors the wrapper reads the
file to CPU, ``load_state_dict(strict=False)`` copies it into the tpu parameters, and a
missing name that shares its tpu storage with a loaded one counts as loaded, as
safetensors' own dedup would say; ``strict`` raises safetensors' error. Any other model
goes to safetensors' function.

Note [accelerate checkpoints and the tpu RNG]
``save_accelerator_state`` pickles python, numpy, cpu and each accelerator it names
(cuda, xpu, npu, ...) into ``random_states_<process>.pkl``; tpu is not among them, so
``load_state`` gave back other dropout masks on tpu. The wrapped functions (the names
``Accelerator.save_state`` / ``load_state`` call, in ``accelerate.accelerator``) run
accelerate's own first, then add ``"torch_tpu_manual_seed"`` (every tpu device's state,
as accelerate stores the others) to that file and restore it on load. A file without the
key loads as before.
"""

from __future__ import annotations

import collections
import functools
import inspect
import pathlib
import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import
from torchjax.integrations.accelerate._device import tpu_is_the_accelerator

PATCHED_FOR = "1.16"
_TARGET_MODULE = "accelerate.utils.other"
_NAME = "accelerate clean_state_dict_for_safetensors"
_LOAD_TARGET = "accelerate.checkpointing"
_LOAD_NAME = "accelerate.checkpointing.load_model"


def _on_tpu(model: torch.nn.Module) -> bool:
    return any(t.device.type == "tpu" for t in model.state_dict().values())


def _shared_names(state_dict: dict) -> list[set[str]]:
    """Groups of names whose tpu tensors share one storage (tied weights)."""
    from torchjax.integrations.transformers._loading import tpu_state_dict_to_cpu

    groups = collections.defaultdict(set)
    for name, t in tpu_state_dict_to_cpu(state_dict).items():
        groups[t.untyped_storage().data_ptr()].add(name)
    return [g for g in groups.values() if len(g) > 1]


def _load_model_to_tpu(model, filename, strict: bool):
    import safetensors.torch

    state_dict = safetensors.torch.load_file(filename, device="cpu")
    shared = _shared_names(model.state_dict())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = {m for m in missing if not any(m in g and g & state_dict.keys() for g in shared)}
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            keys = ", ".join(f'"{k}"' for k in sorted(missing))
            error += f"\n    Missing key(s) in state_dict: {keys}"
        if unexpected:
            keys = ", ".join(f'"{k}"' for k in sorted(unexpected))
            error += f"\n    Unexpected key(s) in state_dict: {keys}"
        raise RuntimeError(error)
    return missing, unexpected


def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(model, filename, strict=True, device="cpu", **kwargs):
        if not _on_tpu(model):
            return original(model, filename, strict=strict, device=device, **kwargs)
        return _load_model_to_tpu(model, filename, strict)

    return load_model


def _wrap_clean(original):
    @functools.wraps(original)
    def clean_state_dict_for_safetensors(state_dict: dict):
        from torchjax.integrations.transformers._loading import tpu_state_dict_to_cpu

        return original(tpu_state_dict_to_cpu(state_dict))

    return clean_state_dict_for_safetensors


def install() -> None:
    """Wrap ``clean_state_dict_for_safetensors`` (Note [accelerate's safetensors save of
    tpu tensors]); idempotent."""
    if _patches.is_recorded(_NAME):
        return
    other = sys.modules[_TARGET_MODULE]
    _patches.replace_attr(
        other,
        "clean_state_dict_for_safetensors",
        _wrap_clean(other.clean_state_dict_for_safetensors),
        name=_NAME,
        why="Accelerator.save_state of tpu tensors (no host storage pointer to dedup by)",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


def install_load() -> None:
    """Wrap ``accelerate.checkpointing.load_model`` (same Note); idempotent."""
    if _patches.is_recorded(_LOAD_NAME):
        return
    checkpointing = sys.modules[_LOAD_TARGET]
    _patches.replace_attr(
        checkpointing,
        "load_model",
        _wrap_load_model(checkpointing.load_model),
        name=_LOAD_NAME,
        why="Accelerator.load_state into a model on tpu (no host storage pointer to dedup by)",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


_RNG_TARGET = "accelerate.accelerator"
_RNG_NAME = "accelerate save/load_accelerator_state"
_TPU_KEY = "torch_tpu_manual_seed"


def _rng_file(signature, args, kwargs, directory_arg: str) -> pathlib.Path | None:
    from accelerate.utils import RNG_STATE_NAME

    bound = signature.bind(*args, **kwargs)
    path = pathlib.Path(bound.arguments[directory_arg])
    path = path / f"{RNG_STATE_NAME}_{bound.arguments['process_index']}.pkl"
    return path if path.is_file() else None


def _load_states(path: pathlib.Path) -> dict:
    # accelerate's own reader: weights_only, with the numpy/random globals it allows.
    from accelerate.utils import load

    return load(path)


def _wrap_save_state(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_accelerator_state(*args, **kwargs):
        out = original(*args, **kwargs)
        path = tpu_is_the_accelerator() and _rng_file(signature, args, kwargs, "output_dir")
        if path:
            states = _load_states(path)
            states[_TPU_KEY] = torch.tpu.get_rng_state_all()
            torch.save(states, path)
        return out

    return save_accelerator_state


def _wrap_load_state(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_accelerator_state(*args, **kwargs):
        out = original(*args, **kwargs)
        path = tpu_is_the_accelerator() and _rng_file(signature, args, kwargs, "input_dir")
        if path:
            states = _load_states(path)
            if _TPU_KEY in states:
                torch.tpu.set_rng_state_all(states[_TPU_KEY])
        return out

    return load_accelerator_state


def install_rng() -> None:
    """Wrap the state save/load ``Accelerator`` calls (Note [accelerate checkpoints and
    the tpu RNG]); idempotent."""
    if _patches.is_recorded(_RNG_NAME):
        return
    module = sys.modules[_RNG_TARGET]
    _patches.replace_attrs(
        module,
        {
            "save_accelerator_state": _wrap_save_state(module.save_accelerator_state),
            "load_accelerator_state": _wrap_load_state(module.load_accelerator_state),
        },
        name=_RNG_NAME,
        why="Accelerator.save_state/load_state keep the tpu RNG state",
        package="accelerate",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """The wraps now if their modules are loaded, else right after each is."""
    for target, install_one in (
        (_TARGET_MODULE, install),
        (_LOAD_TARGET, install_load),
        (_RNG_TARGET, install_rng),
    ):
        _after_import.when_imported(
            target,
            install_one,
            why="patch accelerate's safetensors save/load right after the module is imported",
        )
