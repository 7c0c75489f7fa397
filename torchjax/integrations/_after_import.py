"""Run a patch right after a module of another library executes, never importing it.

``import torchjax`` must not import accelerate or transformers (each costs seconds and
most programs never use them), yet their patches must be in place before user code
reaches the patched function. A finder at ``sys.meta_path[0]`` wraps the target module's
loader so the patch runs right after the module body; it removes itself when it fires.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable


class InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``target`` is found by the normal finders, its loader is
    wrapped so ``install()`` runs right after the module executes."""

    def __init__(self, target: str, install: Callable[[], None]):
        self.target = target
        self.install = install

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        # Stays on sys.meta_path until the module executes: a library asking whether
        # the target is installed (``importlib.util.find_spec``, as diffusers and
        # transformers do before importing it) must not use the hook up.
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_then_install(module):
            exec_module(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
                finder.install()

        spec.loader.exec_module = exec_then_install
        return spec


def hooks_for(target: str) -> list[InstallAfterImport]:
    return [f for f in sys.meta_path if isinstance(f, InstallAfterImport) and f.target == target]


def remove_hooks(target: str) -> None:
    """Take the finders for ``target`` off ``sys.meta_path`` (the undo of ``when_imported``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if f not in hooks_for(target)]


def when_imported(target: str, install: Callable[[], None], why: str) -> None:
    """``install()`` now if ``target`` is loaded, else right after it is; a finder added
    for it is recorded as a process-wide change (``why``: what the patch is for)."""
    if target in sys.modules:
        install()
        return
    if not hooks_for(target):
        sys.meta_path.insert(0, InstallAfterImport(target, install))
    from torchjax import _patches

    _patches.record(
        f"sys.meta_path import hook for {target}",
        why=why,
        package=None,
        written_for=None,
        undo=functools.partial(remove_hooks, target),
    )
