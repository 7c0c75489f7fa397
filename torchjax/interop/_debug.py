"""``torchjax.debug_print``: print tensor values where they exist, also inside a trace.

Note [Printing inside a traced function]
Under ``torchjax.jit`` (or ``jax.jit``) a tensor has a shape and a dtype but no value:
the function runs once to be traced, and the compiled program runs later. ``print(t)``
there needs the value and is refused (DataDependentError, whose text says what to do
when the refused op came from printing). ``debug_print`` is JAX's ``jax.debug.print``
for tpu tensors: the program itself prints the values each time it runs, eager or
compiled, in the order of the calls (``ordered=True``). Shapes and dtypes print as
they are (``print(t.shape)``), known while tracing.
"""

from __future__ import annotations

import jax
import torch

from torchjax.interop._convert import array_of as to_jax


def debug_print(fmt: str, *args, **kwargs) -> None:
    """Print ``fmt.format(*args, **kwargs)`` with tensor arguments' values, at run time.

    Works in eager code and inside ``torchjax.jit`` / ``jax.jit``-traced code alike (the
    compiled program prints on every run), as ``jax.debug.print`` does; tpu tensors are
    printed as their values (numpy arrays), other arguments as they are.

    Example::

        @torchjax.jit
        def step(x):
            y = x * 2
            torchjax.debug_print("y = {}, mean {m}", y, m=y.mean())
            return y
    """

    def value(a):
        return to_jax(a) if isinstance(a, torch.Tensor) and a.device.type == "tpu" else a

    jax.debug.print(
        fmt, *[value(a) for a in args], ordered=True, **{k: value(v) for k, v in kwargs.items()}
    )
