"""tpu tensors in forked and spawned children (Note [tpu tensors after fork] in
torchjax/device/_fork.py; Note [Saving tpu tensors] in torchjax/tensor/_protocols.py).
Every case runs in a child interpreter: the failure being guarded against is a hang."""

import json

from tests._child import run_python


def _run_as_main(code: str, tmp_path, timeout: int):
    # "spawn" children import the parent's main module from its file.
    script = tmp_path / "main.py"
    script.write_text(code)
    return run_python(
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", timeout=timeout
    )


_DATASET = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torchjax


class Rows(torch.utils.data.Dataset):
    def __init__(self, device):
        self.data = torch.arange(24.0, device=device).reshape(8, 3)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.data[i] * 2


def sums(device, **kwargs):
    loader = torch.utils.data.DataLoader(Rows(device), batch_size=4, num_workers=1, **kwargs)
    return [b.sum().item() for b in loader]
"""


def test_dataloader_worker_forked_after_jax_started_refuses_tpu_work():
    code = (
        _DATASET
        + """
torch.ones(2, device="tpu").sum().item()  # JAX's runtime is up before the fork
try:
    sums("tpu")
except RuntimeError as e:
    print(json.dumps(str(e)))
else:
    print(json.dumps("no error"))
"""
    )
    out = run_python(code, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    message = json.loads(out.stdout.strip().splitlines()[-1])
    assert "DataLoader worker process 0" in message
    assert "cannot run aten.select.int on a tpu tensor in a forked child process" in message
    assert 'multiprocessing_context="spawn"' in message


def test_dataloader_with_spawn_gets_the_tpu_dataset_by_value(tmp_path):
    code = (
        _DATASET
        + """
if __name__ == "__main__":
    print(json.dumps([sums("cpu"), sums("tpu", multiprocessing_context="spawn")]))
"""
    )
    out = _run_as_main(code, tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    cpu, tpu = json.loads(out.stdout.strip().splitlines()[-1])
    assert tpu == cpu == [132.0, 420.0]


def test_forked_child_refuses_new_tpu_tensors_and_the_parent_keeps_working():
    code = """
import json, os, warnings
warnings.simplefilter("ignore")
import torch
import torchjax

x = torch.arange(4.0, device="tpu")
x.sum().item()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    seen = []
    for make in (lambda: x + 1, lambda: torch.zeros(2, device="tpu"),
                 lambda: torch.ones(2).to("tpu"), lambda: x.cpu()):
        try:
            make()
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e).split(" in a forked")[0])
    os.write(w, json.dumps(seen).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
seen = json.loads(os.read(r, 65536))
print(json.dumps([seen, (x * 2).tolist()]))
"""
    out = run_python(code, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    seen, parent = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == [
        "torchjax: cannot run aten.add.Tensor on a tpu tensor",
        "torchjax: cannot make a tpu tensor",
        "torchjax: cannot make a tpu tensor",
        "torchjax: cannot run aten._to_copy.default on a tpu tensor",
    ]
    assert parent == [0.0, 2.0, 4.0, 6.0]


def test_child_forked_before_jax_started_runs_tpu_ops():
    # ``import torchjax`` alone starts no runtime: the child starts its own.
    code = """
import json, os, warnings
warnings.simplefilter("ignore")
import torch
import torchjax

r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = (torch.arange(3.0, device="tpu") * 2).tolist()
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print(os.read(r, 65536).decode())
"""
    out = run_python(code, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0.0, 2.0, 4.0]


def test_spawned_process_receives_tpu_tensors_of_every_kind(tmp_path):
    code = """
import json, warnings
warnings.simplefilter("ignore")
import torch
import torch.multiprocessing as mp
import torchjax


def kinds():
    z = torch.tensor([1 + 2j, 3 - 1j])
    return {
        "float": torch.arange(6.0).reshape(2, 3),
        "view": torch.arange(12.0).reshape(3, 4).t()[1:],
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "int64 past 2**31": torch.tensor([2**40 + 3, -(2**35)]),
        "bool": torch.tensor([True, False, True]),
        "0-d": torch.tensor(7.0),
        "empty": torch.zeros(0, 3),
        "conj": z.conj(),
    }


def describe(t):
    t = t.detach().cpu().resolve_conj()
    values = torch.view_as_real(t).tolist() if t.is_complex() else t.float().tolist()
    return [str(t.dtype), list(t.shape), values]


def child(q, tensors):
    q.put(json.dumps({k: describe(v) + [v.device.type, v.requires_grad]
                      for k, v in tensors.items()}))


if __name__ == "__main__":
    tensors = {k: v.to("tpu") for k, v in kinds().items()}
    tensors["requires grad"] = torch.ones(2, device="tpu", requires_grad=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q, tensors))
    p.start()
    got = json.loads(q.get(timeout=120))
    p.join()
    want = {k: describe(v) + ["tpu", v.requires_grad] for k, v in tensors.items()}
    print(json.dumps([got == want, got, want]))
"""
    out = _run_as_main(code, tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    same, got, want = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(want) == 9
    assert same, (got, want)
