"""torchjax/checkpoint/_reader.py: the safetensors header and slice reads, against
safetensors.torch on the same file."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from torchjax.checkpoint import SafetensorsFile
from torchjax.tensor import dtypes


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("reader") / "t.safetensors")
    torch.manual_seed(0)
    save_file(
        {
            "w": torch.randn(6, 5),
            "bf16": torch.randn(4, 3, 2).bfloat16(),
            "i64": torch.arange(5, dtype=torch.int64) * 2**33 - 3,
            "scalar": torch.tensor(2.5),
        },
        p,
        metadata={"format": "pt"},
    )
    return p


def _cpu(f, name, index=None):
    return dtypes.numpy_to_cpu_tensor(f.read(name, index))


def test_header_and_whole_reads(path):
    with SafetensorsFile(path) as f:
        assert sorted(f.keys()) == ["bf16", "i64", "scalar", "w"]
        assert f.metadata == {"format": "pt"}
        info = f.info("bf16")
        assert (info.dtype, info.shape, info.nbytes) == (torch.bfloat16, (4, 3, 2), 48)
        from safetensors.torch import load_file

        ref = load_file(path)
        for name in f.keys():
            got = _cpu(f, name)
            assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), name


@pytest.mark.parametrize(
    "index",
    [
        (slice(2, 5),),  # a run of rows: one pread
        (slice(None), slice(1, 4)),  # columns: strided, through the memory map
        (slice(0, 6, 2), slice(None)),  # stepped rows
        (3, slice(0, 5, 2)),  # an int drops its axis
        (Ellipsis, slice(4, 5)),
        (slice(3, 3),),  # empty
    ],
)
def test_slices_equal_torch_indexing(path, index):
    from safetensors.torch import load_file

    ref = load_file(path)
    with SafetensorsFile(path) as f:
        got = _cpu(f, "w", index)
        assert torch.equal(got, ref["w"][index])
        assert torch.equal(_cpu(f, "bf16", index[:1]), ref["bf16"][index[:1]])


def test_errors_name_the_problem(path, tmp_path):
    with SafetensorsFile(path) as f:
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            f.info("nope")
        with pytest.raises(IndexError, match="has 3 axes but tensor 'w'"):
            f.read("w", (slice(None),) * 3)
        with pytest.raises(IndexError, match="out of range"):
            f.read("w", (6,))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(bad)
    header = json.dumps({"x": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}})
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0\0")
    with pytest.raises(TypeError, match="F8_E8M0"):
        SafetensorsFile(odd)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})
    short = tmp_path / "short.safetensors"
    short.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0" * 8)
    with pytest.raises(ValueError, match="need 16 bytes"):
        SafetensorsFile(short)


def test_reads_are_fresh_writable_arrays(path):
    with SafetensorsFile(path) as f:
        a = f.read("w", (slice(None), slice(1, 3)))
        a[...] = 0  # a copy, never a view of the file
        assert np.any(f.read("w") != 0) and a.flags.writeable
