"""Sharded checkpoint reads on 8 simulated devices, run by test_load.py in a subprocess
(XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts).

Every read is recorded: each device slice must be read on its own, once per distinct
slice, with only that slice's bytes (never the whole tensor), and every shard must hold
the CPU values of its block.
"""

import os
import sys
import tempfile

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

import torchjax
from torchjax import checkpoint as ck
from torchjax.checkpoint import _reader

READS = []
_read = _reader.SafetensorsFile.read


def _recording_read(self, name, index=None):
    arr = _read(self, name, index)
    READS.append((name, index, arr.nbytes, self.info(name).nbytes))
    return arr


_reader.SafetensorsFile.read = _recording_read


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)
    print("ok:", what)


def reads_of(name):
    return [r for r in READS if r[0] == name]


def shards_match(t, ref):
    arr = torchjax.to_jax(t)
    ref = ref.float().numpy() if ref.dtype == torch.bfloat16 else ref.numpy()
    for shard in arr.addressable_shards:
        got = np.asarray(shard.data)
        if got.dtype != ref.dtype and got.dtype.name == "bfloat16":
            got = got.astype(np.float32)
        if not np.array_equal(got, ref[shard.index]):
            return False
    return True


def main():
    check(len(jax.devices()) == 8, "8 simulated devices")
    torch.manual_seed(0)
    ref = {
        "rows": torch.randn(16, 8),  # rows split over tp=4, replicated over dp=2
        "cols": torch.randn(6, 16).bfloat16(),  # columns split over tp (a strided read)
        "ids": torch.arange(16, dtype=torch.int64) * 2**33 + 1,  # split 8 ways, int64
        "norm": torch.randn(8),  # replicated
    }
    path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    torch_save_file(ref, path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    specs = {"rows": P("tp", None), "cols": P(None, "tp"), "ids": P(("dp", "tp"))}

    out = ck.load_file(path, sharding={k: NamedSharding(mesh, s) for k, s in specs.items()})

    arr = torchjax.to_jax(out["rows"])
    check(arr.sharding == NamedSharding(mesh, specs["rows"]), "rows carry their NamedSharding")
    check({s.data.shape for s in arr.addressable_shards} == {(4, 8)}, "rows: shards (4, 8)")
    check(len(reads_of("rows")) == 4, "rows: 4 distinct slices read once each (dp copies)")
    check(all(r[2] == 4 * 8 * 4 for r in reads_of("rows")), "rows: each read 1/4 of the bytes")
    check(shards_match(out["rows"], ref["rows"]), "rows: every shard equals its CPU block")

    cols = torchjax.to_jax(out["cols"])
    check({s.data.shape for s in cols.addressable_shards} == {(6, 4)}, "cols: shards (6, 4)")
    check(cols.dtype.name == "bfloat16" and out["cols"].dtype == torch.bfloat16, "cols bf16")
    check([r[2] for r in reads_of("cols")] == [6 * 4 * 2] * 4, "cols: 4 reads of 1/4 each")
    check(shards_match(out["cols"], ref["cols"]), "cols: shards equal CPU blocks")

    ids = torchjax.to_jax(out["ids"])
    check({s.data.shape for s in ids.addressable_shards} == {(2,)}, "ids: 8 shards of (2,)")
    check(ids.dtype == np.int64 and len(reads_of("ids")) == 8, "ids: int64, 8 reads")
    check(all(r[2] == r[3] // 8 for r in reads_of("ids")), "ids: each read 1/8 of the bytes")
    check(torch.equal(out["ids"].cpu(), ref["ids"]), "ids: values past 2**31 kept")

    check(torchjax.to_jax(out["norm"]).sharding.num_devices == 1, "no mesh: one device")

    # Computing with sharded tensors: jax propagates the shardings; values equal CPU.
    y = (out["rows"].T @ out["rows"]).cpu()
    check(torch.allclose(y, ref["rows"].T @ ref["rows"], atol=1e-5), "rows.T @ rows == CPU")

    # The active mesh: PartitionSpecs by a function of the name; None -> replicated.
    READS.clear()
    with torchjax.sharding.mesh(mesh):
        out2 = ck.load_file(path, sharding=lambda name: specs.get(name), dtype=torch.float32)
    norm = torchjax.to_jax(out2["norm"])
    check(norm.sharding == NamedSharding(mesh, P()), "mesh active: None -> replicated")
    check(len(reads_of("norm")) == 1, "replicated: read once, copied to 8 devices")
    check(out2["cols"].dtype == torch.float32, "dtype= casts per slice")
    check(shards_match(out2["cols"], ref["cols"].float()), "cast slices equal CPU cast")
    check(torch.equal(out2["ids"].cpu(), ref["ids"]), "ints not cast")

    # Saving sharded tensors gathers them: an ordinary file, equal values.
    saved = os.path.join(os.path.dirname(path), "saved.safetensors")
    ck.save_file(out, saved)
    back = torch_load_file(saved)
    check(all(torch.equal(back[k], ref[k]) for k in ref), "save_file gathers sharded arrays")
    print("ALL SHARDED CHECKS PASSED")


if __name__ == "__main__":
    main()
