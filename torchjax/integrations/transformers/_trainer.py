"""The tpu RNG state in ``transformers.Trainer`` checkpoints.

Note [Trainer checkpoints and the tpu RNG]
``Trainer._save_rng_state`` writes python, numpy, cpu and each accelerator it knows by
name (cuda, npu, hpu, mlu, musa, xla) into ``rng_state.pth``; tpu is not among them, so a
run resumed from a checkpoint drew other dropout masks on tpu than the run that was not
interrupted. The wrapped methods run transformers' own first, then add the tpu devices'
states under the key ``"tpu"`` in the same file (a list, one state per device, as
``get_rng_state_all`` returns) and restore them on load. A checkpoint without the key (one
written on another machine) loads as before.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from torchjax import _patches
from torchjax.integrations import _after_import

PATCHED_FOR = "5.24"
_TARGET_MODULE = "transformers.trainer"
_NAME = "transformers Trainer RNG state"


def _rng_file(trainer, directory: str) -> str:
    # The file name transformers' own _save_rng_state / _load_rng_state use.
    if trainer.args.world_size <= 1:
        return os.path.join(directory, "rng_state.pth")
    return os.path.join(directory, f"rng_state_{trainer.args.process_index}.pth")


def _load_states(path: str) -> dict:
    # As transformers reads the file: weights_only, numpy's globals allowed.
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        return torch.load(path, weights_only=True)


def _tpu_in_use() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _wrap_save(original):
    @functools.wraps(original)
    def _save_rng_state(self, output_dir: str) -> None:
        original(self, output_dir)
        path = _rng_file(self, output_dir)
        if not _tpu_in_use() or not os.path.isfile(path):
            return
        states = _load_states(path)
        states["tpu"] = torch.tpu.get_rng_state_all()
        torch.save(states, path)

    return _save_rng_state


def _wrap_load(original):
    @functools.wraps(original)
    def _load_rng_state(self, checkpoint: str | None) -> None:
        original(self, checkpoint)
        if checkpoint is None or not _tpu_in_use():
            return
        path = _rng_file(self, checkpoint)
        if not os.path.isfile(path):
            return
        states = _load_states(path)
        if "tpu" in states:
            torch.tpu.set_rng_state_all(states["tpu"])

    return _load_rng_state


def install() -> None:
    """Wrap the Trainer's RNG save/load (Note [Trainer checkpoints and the tpu RNG])."""
    if _patches.is_recorded(_NAME):
        return
    cls = sys.modules[_TARGET_MODULE].Trainer
    _patches.replace_attrs(
        cls,
        {
            "_save_rng_state": _wrap_save(cls.__dict__["_save_rng_state"]),
            "_load_rng_state": _wrap_load(cls.__dict__["_load_rng_state"]),
        },
        name=_NAME,
        why="Trainer checkpoints save and restore the tpu RNG state",
        package="transformers",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if ``transformers.trainer`` is loaded, else right after it is."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="patch the Trainer's RNG checkpointing right after transformers.trainer runs",
    )
