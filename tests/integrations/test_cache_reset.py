"""A reused static cache resets as one program where its reset only zeroes tensors
(Note [A static cache reset as one program] in
torchjax/integrations/transformers/_cache_state.py), with the values ``reset()`` leaves;
other caches reset as written."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as tf  # noqa: E402
from transformers import cache_utils as cu  # noqa: E402

import torchjax  # noqa: E402
from torchjax.integrations.transformers._cache_state import _reset_program, reset  # noqa: E402

LAYERS = 3


def _config():
    return tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip


def _filled_static_cache():
    cache = cu.StaticCache(config=_config(), max_cache_len=16)
    cache.early_initialization(1, 2, 8, torch.float32, torch.device("tpu"))
    for i in range(len(cache.layers)):
        k = torch.full((1, 2, 3, 8), float(i + 1), device="tpu")
        cache.update(k, k * 2, i, {"cache_position": torch.arange(3, device="tpu")})
    assert all(layer.keys.abs().sum().item() > 0 for layer in cache.layers)
    return cache


def _zeroed(cache) -> bool:
    return all(
        layer.keys.abs().sum().item() == 0
        and layer.values.abs().sum().item() == 0
        and int(layer.cumulative_length) == 0
        for layer in cache.layers
    )


def test_a_static_cache_resets_as_one_program():
    cache = _filled_static_cache()
    tensors = [(layer.keys, layer.values) for layer in cache.layers]
    reset(cache)  # traces
    assert _zeroed(cache)
    for i in range(len(cache.layers)):  # filled again
        k = torch.ones((1, 2, 2, 8), device="tpu")
        cache.update(k, k, i, {"cache_position": torch.arange(2, device="tpu")})
    eager, calls = torchjax.stats()["executions"], _reset_program().cache_hits
    traces = _reset_program().trace_count
    reset(cache)
    # No eager op (as written: 3 * LAYERS ops), and not even the reset program: its
    # storages are zeroed by one jax program (Note [A static cache reset as its storages
    # zeroed]).
    assert _reset_program().cache_hits == calls and _reset_program().trace_count == traces
    assert torchjax.stats()["executions"] == eager
    assert _zeroed(cache)
    # The same tensor objects, zeroed in place, as reset() leaves them.
    assert all(
        layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, tensors)
    )
    assert len(cache.layers) == LAYERS


def _pair():
    """The same filled cache on CPU and on tpu."""
    tpu = _filled_static_cache()
    cpu = cu.StaticCache(config=_config(), max_cache_len=16)
    cpu.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    for a, b in zip(cpu.layers, tpu.layers):
        for name in ("keys", "values", "cumulative_length"):
            getattr(a, name).copy_(getattr(b, name).cpu())
    return cpu, tpu


def _assert_same(cpu, tpu):
    for a, b in zip(cpu.layers, tpu.layers, strict=True):
        for name in ("keys", "values", "cumulative_length"):
            x, y = getattr(a, name), getattr(b, name)
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
            assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype


def test_a_changed_cache_resets_as_on_cpu():
    # The zeroing of whole storages checks the cache's tensors at every reset: replaced
    # ones, views into a larger storage, storages shared between layers or with an array
    # the user holds reset as cache.reset() does on CPU.
    cpu, tpu = _pair()
    traces = _reset_program().trace_count
    reset(tpu), cpu.reset()
    _assert_same(cpu, tpu)
    assert _reset_program().trace_count == traces  # zeroed as storages
    checked = 0
    for change in range(4):
        for c in (cpu, tpu):
            device = c.layers[0].keys.device
            fill = torch.arange(2 * 16 * 8, dtype=torch.float32).reshape(1, 2, 16, 8) + change
            if change == 0:  # a new tensor (a new storage) in place of layer 0's keys
                c.layers[0].keys = fill.to(device)
            elif change == 1:  # layer 1's keys a view into a larger storage
                big = torch.cat([fill, fill + 1], dim=0).to(device)
                c.layers[1].keys = big[1:]
            elif change == 2:  # layers 0 and 2 share one values tensor
                c.layers[2].values = c.layers[0].values
                c.layers[0].values.copy_(fill.to(device))
            else:  # plain again, and layer 0's keys held by the user as a jax array
                c.layers[1].keys = fill.to(device).clone()
                c.layers[2].values = fill.to(device) * 2
                c.layers[0].keys.copy_(fill.to(device))
            for layer in c.layers:
                layer.cumulative_length.fill_(change + 3)
        held = torchjax.to_jax(tpu.layers[0].keys) if change == 3 else None
        _assert_same(cpu, tpu)
        program = _reset_program()
        calls = program.trace_count + program.cache_hits
        reset(tpu), cpu.reset()
        _assert_same(cpu, tpu)
        # Changes 1 and 2 (a view, a shared storage) take the program; 0 and 3 do not.
        assert program.trace_count + program.cache_hits - calls == (change in (1, 2))
        if held is not None:  # the user's array kept its values (copied, not donated)
            assert float(held.sum()) == float(fill.sum())
        checked += 1
    assert checked == 4


def test_a_reset_cache_knows_its_length_on_the_host():
    # Note [A reset cache's length known on the host]: generate's reads of the length
    # after the reset (past_length, the mask's q_offset == 0, the room check) and its ops
    # on it need no device; the prefill's write then replaces the known zeros.
    cache = _filled_static_cache()
    reset(cache)
    torchjax.reset_stats()
    past = cache.get_seq_length()
    assert isinstance(past, torch.Tensor) and past.device.type == "tpu"
    assert int(past) == 0 and -(5 - past) == -5 and bool(past == 0)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [0] * LAYERS
    stats = torchjax.stats()
    assert stats["host_reads"] == 0 and stats["executions"] == 0 and stats["host_ops"] == 4
    k = torch.ones((1, 2, 2, 8), device="tpu")
    cache.update(k, k, 0, {"cache_position": torch.arange(2, device="tpu")})
    assert int(cache.get_seq_length()) == 2  # written: read from the device
    assert torchjax.stats()["host_reads"] > 0


def test_a_dynamic_cache_resets_as_written():
    cache = cu.DynamicCache(config=_config())
    for i in range(LAYERS):
        k = torch.ones((1, 2, 3, 8), device="tpu")
        cache.update(k, k, i)
    reset(cache)
    # DynamicLayer.reset drops its tensors (Python state a program could not move).
    assert all(layer.keys is None and not layer.is_initialized for layer in cache.layers)
    assert cache.get_seq_length() == 0


def _arrays(cache) -> list:
    return [
        torchjax.to_jax(getattr(layer, name))
        for layer in cache.layers
        for name in ("keys", "values", "cumulative_length")
    ]


def test_a_reset_cache_left_as_it_was_is_not_zeroed_again():
    # Note [A kept cache zeroed behind the decode loop]: a second reset of a cache its
    # first reset zeroed, nothing written since, leaves the very arrays of zeros (no
    # program), with the lengths still known on the host; any change since makes it
    # reset as written, as on CPU.
    cpu, tpu = _pair()
    reset(tpu), cpu.reset()
    zeros = _arrays(tpu)
    reset(tpu)
    assert all(a is b for a, b in zip(_arrays(tpu), zeros, strict=True))
    torchjax.reset_stats()
    assert int(tpu.get_seq_length()) == 0 and torchjax.stats()["host_reads"] == 0
    _assert_same(cpu, tpu)

    def write(c):  # a step's write at positions 0..1 of every layer
        for i in range(LAYERS):
            k = torch.full((1, 2, 2, 8), 3.0, device=c.layers[0].keys.device)
            c.update(k, k, i, {"cache_position": torch.arange(2, device=k.device)})

    def new_keys(c):  # a new tensor in place of layer 1's keys
        c.layers[1].keys = torch.ones_like(c.layers[1].keys)

    def new_storage(c):  # layer 2's values given another storage through .data
        c.layers[2].values.data = torch.full_like(c.layers[2].values, 2.0)

    def new_layer(c):  # a new layer object in place of layer 0, filled
        layer = type(c.layers[0])(max_cache_len=16)
        k = torch.ones((1, 2, 1, 8), device=c.layers[1].keys.device)
        layer.lazy_initialization(k, k)
        layer.update(k, k, {"cache_position": torch.arange(1, device=k.device)})
        c.layers[0] = layer

    def length(c):  # only the lengths written
        for layer in c.layers:
            layer.cumulative_length.fill_(5)

    def dtype(c):  # layer 0's keys replaced by float16 ones
        c.layers[0].keys = torch.ones_like(c.layers[0].keys, dtype=torch.float16)

    checked = 0
    for change in (write, new_keys, new_storage, new_layer, length, dtype):
        change(cpu), change(tpu)
        _assert_same(cpu, tpu)
        before = _arrays(tpu)
        reset(tpu), cpu.reset()
        _assert_same(cpu, tpu)
        assert torchjax.to_jax(tpu.layers[0].keys) is not before[0]  # zeroed anew
        assert int(tpu.get_seq_length()) == 0
        zeros = _arrays(tpu)
        reset(tpu)  # and left alone again
        assert all(a is b for a, b in zip(_arrays(tpu), zeros, strict=True)), change
        checked += 1
    assert checked == 6
