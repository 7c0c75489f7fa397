"""The programs ``torchjax.jit`` traced, as StableHLO text, for tests of what they hold."""

from __future__ import annotations

import re

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun


def lowered(jitted) -> list[str]:
    """The StableHLO of each program ``jitted`` (a ``torchjax.jit`` function) traced."""
    texts = []
    for entry in jitted._entries.values():
        invars = entry.closed.jaxpr.invars
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
        with jax.enable_x64(True):  # torchjax's programs are traced with x64 on
            texts.append(jax.jit(jaxpr_as_fun(entry.closed)).lower(*avals).as_text())
    return texts


def scatters(text: str) -> int:
    """How many scatter operations ``text`` holds."""
    return len(re.findall(r"\"stablehlo\.scatter\"", text))


def equations(jitted) -> list:
    """Every equation of each program ``jitted`` traced, those of nested jaxprs (``jit``,
    ``custom_vjp_call``, ``cond`` bodies) included, a Pallas kernel's body not."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            if eqn.primitive.name == "pallas_call":
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, Jaxpr):
                        walk(sub)

    for entry in jitted._entries.values():
        walk(entry.closed.jaxpr)
    return found
