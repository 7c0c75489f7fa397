"""The active device mesh: ``torchjax.mesh(...)`` over jax's own mesh context.

A mesh names the axes devices are laid out on (``("dp", "tp")``); ``PartitionSpec``s name
those axes. torchjax keeps no mesh state of its own: ``torchjax.mesh`` enters
``jax.set_mesh`` (thread-local, restored on exit, so nesting works), and
``get_mesh()`` reads jax's current concrete mesh. Code written against jax (a
``jax.jit`` with ``PartitionSpec`` shardings, ``jax.sharding.get_mesh()``) sees the same
mesh.

Axes are made ``AxisType.Auto`` (GSPMD: shardings are hints XLA propagates through the
program). jax 0.10's default for ``jax.make_mesh`` is ``Explicit``, where shardings are
part of every array's type and ops with an ambiguous result sharding (a matmul whose
contracted dimension is sharded on both sides) raise; PyTorch code written for one device
does not say how to resolve those, so torchjax leaves it to XLA.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` of ``shape`` with Auto axes (see module docstring).

    Args:
        shape: devices per axis, e.g. ``(2, 4)``; its product must equal the number of
            devices used (``len(devices)``, or ``jax.device_count()`` when ``devices`` is
            None, all processes' devices under ``jax.distributed``).
        axis_names: one name per axis, e.g. ``("dp", "tp")``.
        devices: the devices to lay out, in order (default: ``jax.devices()``, ordered by
            ``jax.make_mesh`` for the hardware's topology).

    Raises:
        ValueError: ``shape`` and ``axis_names`` differ in length, or the device count
            does not match.
    """
    shape, axis_names = tuple(int(n) for n in shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"torchjax.mesh: shape {shape} and axis_names {axis_names} must have the same "
            "length (one name per mesh axis)"
        )
    available = len(devices) if devices is not None else jax.device_count()
    if math.prod(shape) != available:
        raise ValueError(
            f"torchjax.mesh: a mesh of shape {shape} needs {math.prod(shape)} devices, but "
            f"{available} are given ({'devices=' if devices is not None else 'jax.devices()'}). "
            "Pass devices=... or a shape whose product is the device count; on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices."
        )
    return jax.make_mesh(
        shape, axis_names, axis_types=(AxisType.Auto,) * len(shape), devices=devices
    )


class mesh(contextlib.ContextDecorator):
    """Make a device mesh the active one: ``with torchjax.mesh((2, 4), ("dp", "tp")):``.

    Inside, ``torchjax.sharding.shard`` and ``parallelize`` place tensors on this mesh
    when given no ``mesh=``, and jax APIs accept bare ``PartitionSpec``s. On exit the
    previous mesh (or none) is active again; nested meshes restore in order. Also a
    decorator (``@torchjax.mesh((8,), ("tp",))``, entered on every call). With one
    device, ``torchjax.mesh((1,), ("tp",))`` is valid and every placement is a no-op.

    Args:
        shape, axis_names, devices: as for ``make_mesh``; or pass a ready
            ``jax.sharding.Mesh`` as ``shape`` (``axis_names`` then omitted).

    Attributes:
        mesh: the ``jax.sharding.Mesh`` (also what ``with ... as m`` binds).

    Raises:
        ValueError: as ``make_mesh``; or when entered inside a ``torchjax.jit`` trace
            (jax's ``set_mesh`` works only outside jit: enter the mesh around the call).
    """

    def __init__(self, shape, axis_names=None, devices=None):
        if isinstance(shape, Mesh):
            self.mesh = shape
        else:
            if axis_names is None:
                raise ValueError("torchjax.mesh: axis_names is required with a shape")
            self.mesh = make_mesh(shape, axis_names, devices)
        self._contexts: list = []

    def __enter__(self) -> Mesh:
        ctx = jax.set_mesh(self.mesh)
        ctx.__enter__()
        self._contexts.append(ctx)  # a stack: the same object may be entered recursively
        return self.mesh

    def __exit__(self, *exc):
        self._contexts.pop().__exit__(*exc)
        return False


def get_mesh() -> Mesh | AbstractMesh | None:
    """The active ``jax.sharding.Mesh`` (set by ``torchjax.mesh`` or ``jax.set_mesh``),
    or None when there is none. Inside a trace (``torchjax.jit``) jax exposes only the
    mesh's ``AbstractMesh`` (axis names and sizes, no devices): that is returned, and is
    what sharding constraints there need."""
    try:
        current = jax.sharding.get_mesh()
    except ValueError:
        # jax refuses get_mesh() under jit ("can only be used outside of jax.jit").
        current = jax.sharding.get_abstract_mesh()
    return None if current.empty else current


def resolve_mesh(given, who: str) -> Mesh | AbstractMesh:
    """``given`` (a Mesh or a ``torchjax.mesh``) if not None, else the active mesh;
    ValueError naming ``who`` if neither."""
    if isinstance(given, (Mesh, AbstractMesh)):
        return given
    if isinstance(given, mesh):
        return given.mesh
    if given is not None:
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(given).__name__}")
    current = get_mesh()
    if current is None:
        raise ValueError(
            f"{who}: no mesh given and none active. Pass mesh=... or call it inside "
            "`with torchjax.mesh(shape, axis_names):`."
        )
    return current
