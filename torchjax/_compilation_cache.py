"""JAX's persistent compilation cache, on by default, so a second process starts warm.

Note [Persistent compilation cache]
Eager torchjax compiles one small XLA program per op, key and input signature (Note
[Compiled lowerings] in torchjax/ops/cached_compute.py); a fresh process compiles them all
again. JAX can keep compiled executables on disk and load them instead of compiling
(its persistent compilation cache), but it is off unless a directory is set, and it
writes only programs that took at least ``jax_persistent_cache_min_compile_time_secs``
(1 s) to compile - none of the eager-op programs (a few milliseconds each). So
``import torchjax`` turns it on:

- the directory: ``$TORCHJAX_COMPILATION_CACHE`` when it is a path, else
  ``$XDG_CACHE_HOME/torchjax/jax`` (``~/.cache/torchjax/jax`` without XDG_CACHE_HOME),
  made readable by its owner only (JAX trusts what it loads from there);
- ``jax_persistent_cache_min_compile_time_secs`` 0 (every program is written) when it
  still has JAX's default; a value the user chose is kept;
- the size is not bounded (JAX's default: a bound makes every write list the
  directory); delete the directory to empty it, or set ``jax_compilation_cache_max_size``.

Nothing is changed when the user already chose: ``jax_compilation_cache_dir`` set (by
``JAX_COMPILATION_CACHE_DIR``, ``jax.config.update`` or ``set_cache_dir`` before the
import) or ``jax_enable_compilation_cache`` off. ``TORCHJAX_COMPILATION_CACHE=0`` (or
``off``, ``false``, ``no``) turns it off. The change is global JAX configuration, so it is
a recorded patch (Note [Process-wide changes], torchjax/_patches.py):
``torchjax.uninstall()`` puts both options back and drops JAX's cache object, so later
compiles neither read nor write the directory.

The cache key is JAX's (the program, compile options, XLA flags, jax and jaxlib
versions, the device): a new release or other XLA_FLAGS compile again rather than load
a stale program. A hit skips XLA's compile, not tracing and lowering: a warm process
still traces each program once, so fewer programs (Note [Static and traced ints] in
torchjax/ops/cached_compute.py) count in both processes. ``torchjax.stats()["compiles"]``
counts real compiles only; ``persistent_cache_hits`` counts loads.
"""

from __future__ import annotations

import os

import jax

from torchjax import _patches
from torchjax._compat import jax as jax_compat

ENV = "TORCHJAX_COMPILATION_CACHE"
PATCH = "jax persistent compilation cache"
_OFF = frozenset({"0", "off", "false", "no"})
_ON = frozenset({"", "1", "on", "true", "yes"})
_JAX_DEFAULT_MIN_COMPILE_TIME = 1.0


def default_dir() -> str:
    """``$XDG_CACHE_HOME/torchjax/jax``, or ``~/.cache/torchjax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchjax", "jax")


def chosen_dir(setting: str | None) -> str | None:
    """The directory ``$TORCHJAX_COMPILATION_CACHE`` (``setting``) asks for; None: off."""
    value = (setting or "").strip()
    if value.lower() in _OFF:
        return None
    if value.lower() in _ON:
        return default_dir()
    return os.path.expanduser(value)


def install() -> str | None:
    """Turn JAX's persistent cache on (Note [Persistent compilation cache]); the
    directory used, or None when left as it was (off, or the user's own choice)."""
    path = chosen_dir(os.environ.get(ENV))
    config = jax.config
    if (
        path is None
        or config.jax_compilation_cache_dir is not None
        or not config.jax_enable_compilation_cache
    ):
        return None
    os.makedirs(path, mode=0o700, exist_ok=True)
    old_min_time = config.jax_persistent_cache_min_compile_time_secs
    config.update("jax_compilation_cache_dir", path)
    if old_min_time == _JAX_DEFAULT_MIN_COMPILE_TIME:
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def undo():
        config.update("jax_compilation_cache_dir", None)
        config.update("jax_persistent_cache_min_compile_time_secs", old_min_time)
        jax_compat.reset_persistent_cache()

    _patches.record(
        PATCH,
        why=f"JAX's persistent compilation cache in {path}",
        package="jax",
        written_for="0.10",
        undo=undo,
    )
    return path
