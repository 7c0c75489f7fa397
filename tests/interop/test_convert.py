"""to_jax / from_jax: zero copy, dtypes kept, sharding kept, pytrees; DLPack."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax


def ptr(a):
    return a.unsafe_buffer_pointer()


def test_round_trip_is_zero_copy_for_every_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool):
        t = torch.ones(4, 3, dtype=dtype, device="tpu")
        a = torchjax.to_jax(t)
        assert a is t.jax()
        back = torchjax.from_jax(a)
        assert ptr(torchjax.to_jax(back)) == ptr(a)
        assert back.dtype == dtype and back.shape == (4, 3)


def test_int64_and_float64_values_survive():
    t = torch.tensor([2**40 + 1, -(2**62)], device="tpu")
    a = torchjax.to_jax(t)
    assert a.dtype == jnp.int64 and np.asarray(a).tolist() == [2**40 + 1, -(2**62)]
    with jax.enable_x64(True):  # the user's own 64-bit array (JAX narrows it otherwise)
        d = torchjax.from_jax(jax.device_put(np.array([1e300], np.float64)))
    assert d.dtype == torch.float64 and d.item() == 1e300


def test_cpu_tensor_moves_once_and_views_are_their_elements():
    x = torch.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(torchjax.to_jax(x)), x.numpy())
    t = x.to("tpu")
    np.testing.assert_array_equal(np.asarray(torchjax.to_jax(t[:, 1])), x[:, 1].numpy())
    np.testing.assert_array_equal(np.asarray(torchjax.to_jax(t.T)), x.T.numpy())


def test_pytrees_and_errors():
    tree = {"a": torch.ones(2, device="tpu"), "b": [torch.zeros(1, device="tpu"), 3]}
    arrays = torchjax.tree_to_jax(tree)
    assert isinstance(arrays["a"], jax.Array) and arrays["b"][1] == 3
    back = torchjax.tree_from_jax(arrays)
    assert back["a"].device.type == "tpu" and back["b"][1] == 3
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        torchjax.to_jax(np.ones(2))
    with pytest.raises(TypeError, match="expects a jax.Array"):
        torchjax.from_jax(np.ones(2))


def test_sharded_arrays_keep_their_sharding():
    code = textwrap.dedent(
        """
        import jax, numpy as np, torch, torchjax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()).reshape(4), ("x",))
        a = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2),
                           NamedSharding(mesh, P("x")))
        t = torchjax.from_jax(a)
        assert torchjax.to_jax(t) is a
        y = torchjax.to_jax(t * 2)
        assert len(y.sharding.device_set) == 4, y.sharding
        assert (t * 2).cpu().tolist() == (np.arange(16.0).reshape(8, 2) * 2).tolist()
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_dlpack_both_ways_without_copies():
    t = torch.arange(6.0, device="tpu")
    cpu = torch.from_dlpack(t)
    assert cpu.device.type == "cpu" and cpu.data_ptr() == ptr(t.jax())
    assert ptr(jax.dlpack.from_dlpack(t)) == ptr(t.jax())
    roundtrip = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    assert roundtrip.tolist() == t.tolist()
    x = torch.arange(4.0)
    onto = torchjax.interop.from_dlpack(x)
    assert onto.device.type == "tpu" and ptr(onto.jax()) == x.data_ptr()
    # torch's own exporter is untouched for CPU tensors
    assert (
        torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(x)).data_ptr() == x.data_ptr()
    )
