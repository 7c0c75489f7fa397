"""One process-wide budget for every executable torchjax caches, least recently used out.

Note [Executable cache budget]
Each compiled program holds host memory for as long as something references it: on
XLA:CPU about 1-2 MB per executable with jax's staging caches around it (measured: an
eager ``(x @ x.t()).relu().sum()`` grew the process by 16 MB per new shape, over 3 GB
after 200 shapes, and gave nothing back). A loop whose shapes change (variable-length
batches, a server) grew until it was killed. So every cache of compiled programs that
torchjax keeps registers its entries here, and one budget bounds them all:

- what counts as one entry: an eager op's executable for one key and one input
  signature (a table of torchjax/ops/executables.py: single and foreach ops), a view
  plan's read or write program and the fill of a large new tensor
  (torchjax/tensor/_storage.py), one traced signature of
  a ``torchjax.jit`` function, and so of a ``torch.compile(backend="tpu")`` graph
  (torchjax/compile/_entry.py). Each entry is its own ``jax.jit`` object over a function
  made for it alone: jax keys its staging caches (traced jaxprs, lowerings, compiled
  executables) on that function, weakly, so when the entry is dropped jax's caches for
  it go too. (One ``jax.jit`` object seeing 200 shapes keeps 200 executables, and
  ``clear_cache()`` on it returns only some of their memory: measured 70 of 184 MB.)
- a hit moves its entry to the most recently used end (one ``OrderedDict.move_to_end``);
  a new entry past the budget evicts the least recently used ones. Evicting calls the
  owner's callback, which drops its references; the next call with that signature
  compiles again (counted in ``traces`` and ``compiles``) and gives the same values.
- the budget is a count of entries (``TORCHJAX_CACHE_ENTRIES``, default 1024) and, if
  set, bytes of generated code (``TORCHJAX_CACHE_BYTES``), read from jax's
  ``memory_analysis()`` of each new eager op executable (the other entries count 0
  bytes: their programs are few per model). XLA:CPU reports 0 bytes of generated code,
  so on CPU only the count bounds memory; the bytes are measured only while a byte
  budget is set (a lower-and-compile cache hit, about 2 ms per new entry).
  ``torchjax.set_cache_budget(entries=..., bytes=...)`` changes both at run time and
  evicts at once down to them.
- what stays outside the budget: jax's own staging caches, keyed on jax's library
  functions (the ``jnp``/``lax`` functions every lowering calls) and on abstract shapes:
  traced jaxprs, lowerings, sharding records. Most are bounded (2048-4096 entries each),
  one (``trace_to_jaxpr``) is not, and for a tiny Llama forward they grew 3.3 MB per new
  sequence length, without end (+729 MB after 200 lengths under a budget of 64 entries;
  unjitted ``jnp`` +4.3 GB). So each turnover of the budget (as many evictions as it holds
  entries, 64 at least) also clears those caches (``clear_staging_caches`` in
  torchjax/_compat/jax.py: ``jax._src.util.clear_all_caches``). It leaves every jitted
  function's C++ executable cache alone, so a repeated call still finds its executable;
  the next trace of a new shape re-traces jax's library functions (microseconds each).
  A workload whose shapes repeat never evicts and never clears. It is a process-wide
  action on jax, also felt by the user's own JAX code (a new trace there re-traces the
  library functions too): ``TORCHJAX_CLEAR_JAX_CACHES=0`` or
  ``set_cache_budget(clear_jax_caches=False)`` turns it off. Counted in
  ``jax_cache_clears``. jax's op-by-op primitive executables (ops torchjax runs op by op:
  one per primitive and shape, bounded at 4096) are among those caches and go too.

Counters (``torchjax.stats()["executables"]``): ``entries`` held, ``bytes`` measured,
``evictions`` and ``jax_cache_clears`` since the last reset, ``budget_entries``,
``budget_bytes``.

Thread safety: the order is changed under one lock; owners' callbacks run after it is
released (an owner may hold its own lock while it admits, never while it is evicted).
A hit on an entry evicted by another thread at the same moment only skips the move.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from torchjax._compat import jax as _compat_jax

_DEFAULT_ENTRIES = 1024
# jax's staging caches are cleared after this many evictions at least (a budget smaller
# than this would otherwise clear them every few calls).
_TURNOVER = 64


def _env_int(name: str, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"torchjax: environment variable {name}={raw!r} must be an integer "
            f"(a count of executables or bytes), or unset for the default ({default})"
        ) from None
    if value < 0:
        raise ValueError(f"torchjax: environment variable {name}={raw!r} must be >= 0")
    return value


class _Budget:
    def __init__(self):
        self.order: OrderedDict = OrderedDict()  # token -> (evict callback, bytes)
        self.max_entries = _env_int("TORCHJAX_CACHE_ENTRIES", _DEFAULT_ENTRIES)
        self.max_bytes = _env_int("TORCHJAX_CACHE_BYTES", None)
        self.clear_jax = os.environ.get("TORCHJAX_CLEAR_JAX_CACHES", "1") != "0"
        self.bytes = 0
        self.evictions = 0
        self.since_clear = 0  # evictions since jax's staging caches were last cleared
        self.jax_clears = 0
        self.lock = threading.Lock()

    def admit(self, token, evict, nbytes: int = 0) -> None:
        """Hold ``token`` (a new cache entry) until evicted; ``evict()`` drops it."""
        with self.lock:
            old = self.order.pop(token, None)
            if old is not None:
                self.bytes -= old[1]
            self.order[token] = (evict, nbytes)
            self.bytes += nbytes
            victims = self._over()
        _run(victims)

    def resize(self, token, nbytes: int) -> None:
        with self.lock:
            old = self.order.get(token)
            if old is None:
                return  # evicted meanwhile
            self.order[token] = (old[0], nbytes)
            self.bytes += nbytes - old[1]
            victims = self._over()
        _run(victims)

    def forget(self, token) -> None:
        """The owner dropped ``token`` itself (a cleared cache): no eviction counted."""
        with self.lock:
            old = self.order.pop(token, None)
            if old is not None:
                self.bytes -= old[1]

    def _over(self) -> list:
        # The newest entry may go too (a budget of 0, or one entry over the bytes): the
        # caller still holds it for the call at hand, it is just not kept.
        victims = []
        order = self.order
        while order and (
            len(order) > self.max_entries
            or (self.max_bytes is not None and self.bytes > self.max_bytes)
        ):
            _, (evict, nbytes) = order.popitem(last=False)
            self.bytes -= nbytes
            self.evictions += 1
            victims.append(evict)
        self.since_clear += len(victims)
        if self.clear_jax and victims and self.since_clear >= max(self.max_entries, _TURNOVER):
            self.since_clear = 0
            self.jax_clears += 1
            victims.append(_compat_jax.clear_staging_caches)
        return victims

    def set(self, entries, nbytes) -> None:
        with self.lock:
            self.max_entries, self.max_bytes = entries, nbytes
            victims = self._over()
        _run(victims)


def _run(victims) -> None:
    for evict in victims:
        evict()


BUDGET = _Budget()
# A hit: ``touch(token)`` (KeyError when another thread just evicted it: ignore).
touch = BUDGET.order.move_to_end


def hit(token) -> None:
    """Mark ``token`` as just used."""
    try:
        touch(token)
    except KeyError:
        pass


def admit(token, evict, nbytes: int = 0) -> None:
    BUDGET.admit(token, evict, nbytes)


def cached(table: dict, key, build):
    """``table[key]``: made by ``build()`` and admitted on first use, marked on a hit.
    Evicted, the entry leaves ``table`` and is built again on its next use."""
    token = table.get(key)
    if token is not None:
        hit(token)
        return token
    token = table[key] = build()

    def evict():
        if table.get(key) is token:
            del table[key]

    admit(token, evict)
    return token


def forget(token) -> None:
    BUDGET.forget(token)


def resize(token, nbytes: int) -> None:
    """``token``'s executable measured ``nbytes`` (evicts if that passes the budget)."""
    BUDGET.resize(token, nbytes)


def measure_bytes() -> bool:
    """Whether new entries should measure their executable's bytes (a byte budget is set)."""
    return BUDGET.max_bytes is not None


def code_bytes(jitted, args) -> int:
    """Bytes of generated code of ``jitted``'s executable for ``args`` (just compiled:
    the lowering and compilation are cache hits), 0 where the backend reports none."""
    stats = jitted.lower(*args).compile().memory_analysis()
    if stats is None:
        return 0
    return int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)


_UNCHANGED = object()


def set_cache_budget(
    entries=_UNCHANGED,
    bytes=_UNCHANGED,  # noqa: A002
    clear_jax_caches=_UNCHANGED,
) -> None:
    """Set the process-wide budget of cached executables (Note [Executable cache
    budget] in torchjax/_budget.py) and evict down to it now.

    Args:
        entries: how many compiled programs torchjax keeps (eager op executables per
            input signature, view plans, ``torchjax.jit`` and ``torch.compile``
            signatures), least recently used evicted first; 0 keeps none (every call
            compiles again). Omitted: unchanged.
        bytes: a bound on the bytes of generated code of those programs, as the
            backend reports them (XLA:CPU reports none); None removes the bound.
            Omitted: unchanged.
        clear_jax_caches: whether each turnover of the budget (as many evictions as it
            holds entries, 64 at least) also clears jax's own staging caches, which
            otherwise hold the traced programs of every shape seen (default True;
            ``TORCHJAX_CLEAR_JAX_CACHES=0`` turns it off). Omitted: unchanged.
    """
    if entries is _UNCHANGED:
        entries = BUDGET.max_entries
    if bytes is _UNCHANGED:
        bytes = BUDGET.max_bytes  # noqa: A001
    if entries is None:
        raise ValueError("torchjax.set_cache_budget: entries must be a non-negative int, got None")
    for name, v in (("entries", entries), ("bytes", bytes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(
                f"torchjax.set_cache_budget: {name} must be a non-negative int or None, got {v!r}"
            )
    if clear_jax_caches is not _UNCHANGED:
        if not isinstance(clear_jax_caches, bool):
            raise ValueError(
                "torchjax.set_cache_budget: clear_jax_caches must be a bool, got "
                f"{clear_jax_caches!r}"
            )
        BUDGET.clear_jax = clear_jax_caches
    BUDGET.set(entries, bytes)


def cache_budget() -> dict:
    """The budget and what it holds: ``{"entries", "bytes", "evictions",
    "budget_entries", "budget_bytes", "jax_cache_clears"}``."""
    b = BUDGET
    return {
        "entries": len(b.order),
        "bytes": b.bytes,
        "evictions": b.evictions,
        "budget_entries": b.max_entries,
        "budget_bytes": b.max_bytes,
        "jax_cache_clears": b.jax_clears,
    }


def reset_counters() -> None:
    BUDGET.evictions = 0
    BUDGET.jax_clears = 0
