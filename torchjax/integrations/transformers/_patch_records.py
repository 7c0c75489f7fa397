"""The transformers patches in torchjax's list of process-wide changes.

Kept apart from ``_loading.py`` (which makes the patches): this module only records them
in Note [Process-wide changes], with their undo, and checks the transformers release.
"""

from __future__ import annotations

import functools

from torchjax import _patches
from torchjax.integrations import _after_import
from torchjax.integrations.transformers import _loading


def install_loading_when_imported() -> None:
    """``_loading.install_when_imported()``, with both of its changes recorded: the
    ``sys.meta_path`` finder (until transformers is imported) and the wrapped loading
    functions (applied once ``transformers.modeling_utils`` runs)."""
    _loading.install_when_imported()
    if _after_import.hooks_for(_loading._TARGET_MODULE):
        _patches.record(
            "sys.meta_path import hook",
            why="patch transformers' loading right after it is imported, never importing it",
            package=None,
            written_for=None,
            undo=functools.partial(_after_import.remove_hooks, _loading._TARGET_MODULE),
        )
    _patches.record(
        "transformers loading functions",
        why="from_pretrained(device_map='tpu') reads safetensors into jax arrays; "
        "save_pretrained of tpu models (applied when transformers.modeling_utils is imported)",
        package="transformers",
        written_for=_loading.PATCHED_FOR,
        undo=_loading.uninstall,
    )
