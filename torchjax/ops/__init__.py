"""ATen -> jax lowerings, one module per op family, all registered into ops/registry.py."""

from torchjax.ops import activation as _activation  # noqa: F401
from torchjax.ops import amp as _amp  # noqa: F401
from torchjax.ops import asserts as _asserts  # noqa: F401
from torchjax.ops import attention as _attention  # noqa: F401
from torchjax.ops import comparison as _comparison  # noqa: F401
from torchjax.ops import conv as _conv  # noqa: F401
from torchjax.ops import copy as _copy  # noqa: F401
from torchjax.ops import cumulative as _cumulative  # noqa: F401
from torchjax.ops import distance as _distance  # noqa: F401
from torchjax.ops import distributions as _distributions  # noqa: F401
from torchjax.ops import dropout as _dropout  # noqa: F401
from torchjax.ops import embedding as _embedding  # noqa: F401
from torchjax.ops import factory as _factory  # noqa: F401
from torchjax.ops import fft as _fft  # noqa: F401
from torchjax.ops import foreach as _foreach  # noqa: F401
from torchjax.ops import fused_optim as _fused_optim  # noqa: F401
from torchjax.ops import histogram as _histogram  # noqa: F401
from torchjax.ops import host_ops as _host_ops  # noqa: F401
from torchjax.ops import index_along_dim as _index_along_dim  # noqa: F401
from torchjax.ops import indexing as _indexing  # noqa: F401
from torchjax.ops import linalg as _linalg  # noqa: F401
from torchjax.ops import linalg_ldl as _linalg_ldl  # noqa: F401
from torchjax.ops import linalg_qr as _linalg_qr  # noqa: F401
from torchjax.ops import long_tail as _long_tail  # noqa: F401
from torchjax.ops import loss as _loss  # noqa: F401
from torchjax.ops import masking as _masking  # noqa: F401
from torchjax.ops import matmul as _matmul  # noqa: F401
from torchjax.ops import norm as _norm  # noqa: F401
from torchjax.ops import pointwise_binary as _pointwise_binary  # noqa: F401
from torchjax.ops import pointwise_ternary as _pointwise_ternary  # noqa: F401
from torchjax.ops import pointwise_unary as _pointwise_unary  # noqa: F401
from torchjax.ops import pooling as _pooling  # noqa: F401
from torchjax.ops import power as _power  # noqa: F401
from torchjax.ops import random as _random  # noqa: F401
from torchjax.ops import random_bounds as _random_bounds  # noqa: F401
from torchjax.ops import random_indices as _random_indices  # noqa: F401
from torchjax.ops import rearrange as _rearrange  # noqa: F401
from torchjax.ops import reduction as _reduction  # noqa: F401
from torchjax.ops import rnn as _rnn  # noqa: F401
from torchjax.ops import sampling as _sampling  # noqa: F401
from torchjax.ops import scatter_gather as _scatter_gather  # noqa: F401
from torchjax.ops import sort as _sort  # noqa: F401
from torchjax.ops import special as _special  # noqa: F401
from torchjax.ops import transformer as _transformer  # noqa: F401
from torchjax.ops import transformer_nested as _transformer_nested  # noqa: F401
from torchjax.ops import view_ops as _view_ops  # noqa: F401
from torchjax.ops.registry import handler, lowering, register_pointwise

__all__ = ["handler", "lowering", "register_pointwise"]
