"""Sharding: device meshes, ``PartitionSpec`` placement and tensor parallelism.

JAX is the engine (``jax.sharding``: GSPMD, ``jax.distributed`` across processes); this
package maps PyTorch-side objects onto it:

- ``torchjax.mesh(shape, axis_names)`` / ``get_mesh()``: the active mesh (_mesh.py);
- ``shard``, ``shard_``, ``constraint``, ``sharding_of``: tensors on a mesh (_placement.py);
- ``parallelize(model, plan)``: Hugging Face tensor-parallel plans (_plan.py);
- ``TensorParallelConfig`` + ``load_pretrained``: a transformers model read from its
  safetensors straight into sharded parameters, each device reading its block (_load.py).
"""

from jax.sharding import Mesh as Mesh
from jax.sharding import NamedSharding as NamedSharding
from jax.sharding import PartitionSpec as PartitionSpec

from torchjax.device._mesh import get_mesh as get_mesh
from torchjax.device._mesh import make_mesh as make_mesh
from torchjax.device._mesh import mesh as mesh
from torchjax.sharding._load import TensorParallelConfig as TensorParallelConfig
from torchjax.sharding._load import load_pretrained as load_pretrained
from torchjax.sharding._placement import constraint as constraint
from torchjax.sharding._placement import shard as shard
from torchjax.sharding._placement import shard_ as shard_
from torchjax.sharding._placement import sharding_of as sharding_of
from torchjax.sharding._plan import STYLES as STYLES
from torchjax.sharding._plan import parallelize as parallelize
from torchjax.sharding._plan import plan_shardings as plan_shardings

P = PartitionSpec

__all__ = [
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "STYLES",
    "TensorParallelConfig",
    "constraint",
    "get_mesh",
    "load_pretrained",
    "make_mesh",
    "mesh",
    "parallelize",
    "plan_shardings",
    "shard",
    "shard_",
    "sharding_of",
]
