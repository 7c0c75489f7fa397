"""Storages of tpu tensors as torch reports them (torchjax/tensor/_addresses.py), each
checked against the same code on CPU tensors."""

import copy
import gc
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import torchjax  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")


def ptr(t):
    return t.untyped_storage().data_ptr()


# name -> (fn of a (15, 4) float tensor, whether CPU's result shares its storage)
_DERIVED = {
    "view": (lambda x: x.view(20, 3), True),
    "reshape_as_view": (lambda x: x.reshape(20, 3), True),
    "reshape_copying": (lambda x: x.t().reshape(20, 3), False),
    "slice": (lambda x: x[2:, 1], True),
    "transpose": (lambda x: x.transpose(0, 1), True),
    "expand": (lambda x: x.expand(2, 15, 4), True),
    "as_strided": (lambda x: x.as_strided((2, 2), (1, 1), 3), True),
    "diagonal": (lambda x: x.diagonal(), True),
    "unsqueeze": (lambda x: x.unsqueeze(0), True),
    "view_dtype": (lambda x: x.view(torch.int16), True),
    "detach": (lambda x: x.detach(), True),
    "contiguous_of_contiguous": (lambda x: x.contiguous(), True),
    "contiguous_of_transpose": (lambda x: x.t().contiguous(), False),
    "clone": (lambda x: x.clone(), False),
    "add": (lambda x: x + 1, False),
}


@pytest.mark.parametrize("name", sorted(_DERIVED))
def test_views_share_the_storage_of_their_base_copies_do_not(name):
    # Before: untyped_storage().data_ptr() of any tpu tensor raised "Attempted to access
    # the data pointer on an invalid python storage".
    fn, shares = _DERIVED[name]
    x = torch.arange(60.0).reshape(15, 4)
    t = x.to("tpu")
    assert (ptr(fn(x)) == ptr(x)) is shares
    assert (ptr(fn(t)) == ptr(t)) is shares
    assert (fn(t).storage().data_ptr() == t.storage().data_ptr()) is shares
    assert ptr(t) != 0


@pytest.mark.parametrize("name", sorted(_DERIVED))
def test_data_ptr_offset_and_nbytes_as_on_cpu(name):
    fn, _ = _DERIVED[name]
    x = torch.arange(60.0).reshape(15, 4)
    a, b = fn(x), fn(x.to("tpu"))
    for u in (a, b):
        assert u.data_ptr() == ptr(u) + u.storage_offset() * u.element_size()
    assert b.storage_offset() == a.storage_offset()
    assert b.untyped_storage().nbytes() == a.untyped_storage().nbytes()
    assert b.storage().size() == a.storage().size() and b.storage().dtype == a.storage().dtype


def test_complex_real_and_imag_share_the_storage():
    z = torch.randn(3, dtype=torch.complex64)
    t = z.to("tpu")
    for part in (lambda c: c.real, lambda c: c.imag, torch.view_as_real):
        assert ptr(part(t)) == ptr(t) and ptr(part(z)) == ptr(z)
        assert part(t).untyped_storage().nbytes() == part(z).untyped_storage().nbytes() == 24
        assert part(t).data_ptr() - ptr(t) == part(z).data_ptr() - ptr(z)


def test_one_storage_object_per_root_as_on_cpu():
    for x in (torch.arange(6.0), torch.arange(6.0).to("tpu")):
        assert x.untyped_storage() is x[1:].untyped_storage()
        assert x.untyped_storage() is not x.clone().untyped_storage()


def test_a_storage_outliving_its_tensors_names_the_limit():
    # A CPU storage keeps its memory; a tpu storage does not keep its root (Note [torch
    # storages of tpu tensors]): using it after its tensors died says so.
    s = torch.arange(4.0)[1:].untyped_storage()
    assert torch.empty(0).set_(s).tolist() == [0.0, 1.0, 2.0, 3.0]
    s = torch.arange(4.0, device="tpu")[1:].untyped_storage()
    gc.collect()
    with pytest.raises(RuntimeError, match="aten::set_: .* freed: a tpu storage does not keep"):
        torch.empty(0, device="tpu").set_(s)
    with pytest.raises(RuntimeError, match="freed"):
        bytes(s)


def test_storage_identity_is_stable_while_the_root_lives():
    # torch compares storages by StorageImpl (StorageWeakRef, _cdata): as on CPU, every
    # call and every view of a root give the same one.
    from torch.multiprocessing.reductions import StorageWeakRef

    for x in (torch.arange(6.0), torch.arange(6.0).to("tpu")):
        first = x.untyped_storage()._cdata
        gc.collect()
        assert x[1:].storage()._cdata == first
        assert StorageWeakRef(x.untyped_storage()) == StorageWeakRef(x.t().untyped_storage())
        assert StorageWeakRef(x.untyped_storage()) != StorageWeakRef(x.clone().untyped_storage())


def test_storage_of_a_grown_root_follows_it():
    for x in (torch.arange(4.0), torch.arange(4.0).to("tpu")):
        v = x[1:]
        x.resize_(1000)
        assert x.untyped_storage().nbytes() == v.untyped_storage().nbytes() == 4000
        assert v.data_ptr() == ptr(v) + 4 and ptr(v) == ptr(x)
    # Distinct tpu storages never overlap, also after one grew.
    other = torch.zeros(1, device="tpu")
    lo, hi = sorted([x, other], key=ptr)
    assert ptr(lo) + lo.untyped_storage().nbytes() <= ptr(hi)


def test_set_to_its_own_storage_with_new_strides():
    # PyTorch's test_view_ops.py test_contiguous: set_ refused "a storage with no data".
    for device in ("cpu", "tpu"):
        x = torch.randn(1, 16, 5, 5, device=device)
        stride = list(x.stride())
        stride[0] = 20
        x.set_(x.storage(), 0, x.size(), stride)
        assert x.is_contiguous() and x.stride() == (20, 25, 5, 1)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_set_to_another_tensors_storage_aliases_it(device):
    a = torch.arange(6.0, device=device)
    b = torch.empty(0, device=device).set_(a.untyped_storage(), 2, (2,), (1,))
    b.add_(10)
    assert a.tolist() == [0.0, 1.0, 12.0, 13.0, 4.0, 5.0]
    whole = torch.empty(0, device=device).set_(a.untyped_storage())
    assert whole.shape == (6,) and ptr(whole) == ptr(a)
    # Another dtype reads the same bytes (an interpretation of the root on tpu).
    ints = torch.empty(0, dtype=torch.int32, device=device).set_(a.untyped_storage(), 1, (2,))
    assert ints.tolist() == a[1:3].view(torch.int32).tolist()
    # A slice of the storage starts where it starts.
    part = torch.empty(0, device=device).set_(a.untyped_storage()[8:16])
    assert part.tolist() == [12.0, 13.0] and part.data_ptr() == ptr(a) + 8


def test_storage_of_a_second_device_stays_there():
    # Its own device's tensors view it; another device's refuse it with torch's message.
    code = textwrap.dedent(
        """
        import torch, torchjax
        a = torch.arange(4.0, device="tpu:1")
        s = a.untyped_storage()
        assert s.device == torch.device("tpu", 1)
        b = torch.empty(0, device="tpu:1").set_(s, 1, (2,))
        assert b.device == a.device and b.tolist() == [1.0, 2.0]
        try:
            torch.empty(0, device="tpu:0").set_(s)
        except RuntimeError as e:
            assert 'different device "tpu:1"' in str(e), e
        else:
            raise AssertionError("set_ across devices was accepted")
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_set_past_the_end_grows_the_storage_as_on_cpu():
    for device in ("cpu", "tpu"):
        a = torch.arange(4.0, device=device)
        b = torch.empty(0, device=device).set_(a.untyped_storage(), 0, (10,), (1,))
        assert a.untyped_storage().nbytes() == 40 and b[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
        b[0] = 7
        assert a[0].item() == 7


def test_set_to_a_misaligned_slice_names_the_op():
    a = torch.arange(4.0, device="tpu")
    with pytest.raises(RuntimeError, match="aten::set_.*whole number of torch.float32"):
        torch.empty(0, device="tpu").set_(a.untyped_storage()[2:10])


@pytest.mark.parametrize(
    "op",
    [
        lambda s: bytes(s),
        lambda s: s.cpu().tolist(),
        lambda s: [s[0], s[5]],
        lambda s: s.clone().tolist(),
        lambda s: list(s[4:8]),
    ],
)
def test_storage_reads_give_the_bytes(op):
    x = torch.arange(6.0)
    assert op(x.to("tpu").untyped_storage()) == op(x.untyped_storage())


def test_storage_writes_reach_the_tensor():
    for device in ("cpu", "tpu"):
        x = torch.arange(4.0, device=device)
        x.untyped_storage()[4:8].fill_(0)
        assert x.tolist() == [0.0, 0.0, 2.0, 3.0]
        x.untyped_storage().copy_(torch.ones(4).untyped_storage())
        assert x.tolist() == [1.0] * 4


@pytest.mark.parametrize(
    "roundtrip",
    [
        lambda s: pickle.loads(pickle.dumps(s)),
        copy.deepcopy,
        copy.copy,
        lambda s: _saved(s, zipfile=True),
        lambda s: _saved(s, zipfile=False),
    ],
)
def test_typed_storage_roundtrips(roundtrip):
    x = torch.arange(6.0)
    t = x.to("tpu")
    got, want = roundtrip(t[2:].storage()), roundtrip(x[2:].storage())
    assert got.device == t.device and got.dtype == want.dtype
    assert got.tolist() == want.tolist()


def _saved(storage, zipfile):
    buf = io.BytesIO()
    torch.save(storage, buf, _use_new_zipfile_serialization=zipfile)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_safetensors_finds_shared_tensors_as_on_cpu():
    from safetensors.torch import _find_shared_tensors, _is_complete, storage_ptr

    def groups(device):
        emb = torch.nn.Parameter(torch.randn(5, 3, device=device))
        other = torch.randn(5, 3, device=device)
        state = {"emb": emb, "head": emb, "row": emb[1], "other": other, "view": other.view(15)}
        found = sorted(sorted(g) for g in _find_shared_tensors(state) if len(g) > 1)
        complete = {k: _is_complete(v) for k, v in state.items()}
        return found, complete, storage_ptr(emb) == storage_ptr(other)

    assert groups("tpu") == groups("cpu")
    assert groups("tpu")[0] == [["emb", "head", "row"], ["other", "view"]]


def test_transformers_id_tensor_storage_tells_tied_from_distinct():
    from transformers.pytorch_utils import id_tensor_storage

    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    ln = torch.nn.LayerNorm(3)
    m.to("tpu")
    ln.to("tpu")
    ids = [id_tensor_storage(t) for t in (m[0].weight, m[1].weight, ln.weight, ln.bias)]
    assert ids[0] == ids[1] and len(set(ids)) == 3
    assert ids[0][0] == torch.device("tpu", 0) and ids[0][2] == 5 * 3 * 4


def _tied_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    return m


def test_safetensors_save_and_load_model_of_tied_tpu_weights(tmp_path):
    # safetensors dedups tied weights by storage (storage_ptr/storage_size), on save
    # and on load; both refused a tpu model before.
    from safetensors.torch import load_file, load_model, save_model

    save_model(_tied_model(), tmp_path / "cpu.safetensors")
    save_model(_tied_model().to("tpu"), tmp_path / "tpu.safetensors")
    cpu, tpu = load_file(tmp_path / "cpu.safetensors"), load_file(tmp_path / "tpu.safetensors")
    assert sorted(tpu) == sorted(cpu) and len(cpu) == 1
    for name in cpu:
        assert torch.equal(tpu[name], cpu[name])
    target = _tied_model().to("tpu")
    with torch.no_grad():
        target[0].weight.zero_()
    missing, unexpected = load_model(target, tmp_path / "cpu.safetensors")
    assert not missing and not unexpected
    assert torch.equal(target[1].weight.cpu(), _tied_model()[1].weight)
    assert target[1].weight is target[0].weight


def test_asking_for_the_storage_does_not_delay_freeing_the_data():
    # No reference cycle between a root and its torch storage: the device memory goes
    # when the last tensor does, not at a later garbage collection.
    import weakref

    gc.disable()
    try:
        t = torch.arange(4.0, device="tpu")
        assert t[1:].untyped_storage().nbytes() == 16
        root = weakref.ref(t._storage)
        del t
        assert root() is None
    finally:
        gc.enable()


def test_storage_size_under_torch_compile_as_on_cpu():
    # Fake tpu tensors answer with their inner fake's storage (Note [JaxTensor under
    # Dynamo]), which Dynamo sizes as the real one.
    def f(a):
        return a + a.untyped_storage().nbytes()

    want = torch.compile(f, backend="eager")(torch.zeros(4)[1:])
    got = torch.compile(f, backend="tpu")(torch.zeros(4, device="tpu")[1:])
    assert got.cpu().tolist() == want.tolist() == [16.0] * 3
