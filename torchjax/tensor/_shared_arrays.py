"""Arrays that user JAX code may hold under another name: never donated (Note [Arrays
shared with JAX code are not donated]).

Note [Arrays shared with JAX code are not donated]
Donation (``torchjax.jit``'s state, fused segments, captured optimizer steps, plain
eager in-place foreach calls) frees an old array's buffer when Python's reference count
says nothing else holds it (Note [Donation never takes the user's copy] in
torchjax/compile/_donate.py). A reference count sees Python objects, not buffers, and
JAX can give two Array objects one buffer: ``jax.device_put(a, device)`` of an array
already there returns a new object over ``a``'s buffer, and DLPack hands a buffer to
other libraries without a copy. So an array a tensor gives to user code
(``torchjax.to_jax``, ``__dlpack__``) or takes from it (``torchjax.from_jax``) is
remembered here, weakly, and no donation takes it: the step
that writes its tensor makes a new buffer, as without donation, and the tensor's next
array (made by torchjax) is donated again. Within torchjax arrays reach JAX functions
(``torchjax.jax_function``, flax modules) through the unremembered path: those calls hold
them only while they run. ``Tensor.jax()`` does not remember either: transformers calls
it on the tensors it checks for tracing (a static cache's every call), and remembering
those made a compiled generate copy its cache before each donation.
"""

from __future__ import annotations

import weakref

import jax

_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def remember(arr):
    """``arr``, remembered as held by user code (a tracer is not: it is not donated)."""
    if isinstance(arr, jax.Array) and not isinstance(arr, jax.core.Tracer):
        _SHARED[id(arr)] = arr
    return arr


def shared(arr) -> bool:
    """Whether user code may hold ``arr``'s buffer (Note [Arrays shared with JAX code
    are not donated])."""
    return _SHARED.get(id(arr)) is arr
