"""tpu tensors in forked and spawned children (Note [tpu tensors after fork] in
torchjax/device/_fork.py; Note [Saving tpu tensors] in torchjax/tensor/_protocols.py).
Every case runs in a child interpreter: the failure being guarded against is a hang.
Two scripts (one forking, one spawning) hold all the cases, each run once."""

import json

import pytest

from tests._child import run_python

_DATASET = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.multiprocessing as mp
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

_FORKS = (
    _DATASET
    + """
def in_child(work):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps(work()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    return json.loads(os.read(r, 1 << 16))


def attempts(x):
    seen = []
    for make in (lambda: x + 1, lambda: torch.zeros(2, device="tpu"),
                 lambda: torch.ones(2).to("tpu"), lambda: x.cpu()):
        try:
            make()
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e).split(" in a forked")[0])
    return seen


result = {}
# ``import torchjax`` alone starts no runtime: a child forked now starts its own.
result["before"] = in_child(lambda: (torch.arange(3.0, device="tpu") * 2).tolist())
x = torch.arange(4.0, device="tpu")
x.sum().item()  # JAX's runtime is up from here
result["after"] = in_child(lambda: attempts(x))
result["parent"] = (x * 2).tolist()
try:
    sums("tpu")
    result["loader"] = "no error"
except RuntimeError as e:
    result["loader"] = str(e)
print(json.dumps(result))
"""
)

_SPAWNS = (
    _DATASET
    + """
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
    return [str(t.dtype), list(t.shape), values, t.device.type, t.requires_grad]


def child(q, tensors):
    q.put(json.dumps({k: describe(v)[:3] + [v.device.type, v.requires_grad]
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
    want = {k: describe(v)[:3] + ["tpu", v.requires_grad] for k, v in tensors.items()}
    loader = [sums("cpu"), sums("tpu", multiprocessing_context="spawn")]
    print(json.dumps({"got": got, "want": want, "loader": loader}))
"""
)


def _last_json(out):
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def forks():
    return _last_json(run_python(_FORKS, timeout=300))


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    # "spawn" children import the parent's main module from its file.
    script = tmp_path_factory.mktemp("spawn") / "main.py"
    script.write_text(_SPAWNS)
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    return _last_json(run_python(code, timeout=400))


def test_child_forked_before_jax_started_runs_tpu_ops(forks):
    assert forks["before"] == [0.0, 2.0, 4.0]


def test_forked_child_refuses_tpu_work_and_the_parent_keeps_working(forks):
    assert forks["after"] == [
        "torchjax: cannot run aten.add.Tensor on a tpu tensor",
        "torchjax: cannot make a tpu tensor",
        "torchjax: cannot make a tpu tensor",
        "torchjax: cannot run aten._to_copy.default on a tpu tensor",
    ]
    assert forks["parent"] == [0.0, 2.0, 4.0, 6.0]


def test_dataloader_worker_forked_after_jax_started_refuses_tpu_work(forks):
    message = forks["loader"]
    assert "DataLoader worker process 0" in message
    assert "cannot run aten.select.int on a tpu tensor in a forked child process" in message
    assert 'multiprocessing_context="spawn"' in message


def test_spawned_process_receives_tpu_tensors_of_every_kind(spawns):
    assert len(spawns["want"]) == 9
    assert spawns["got"] == spawns["want"]


def test_dataloader_with_spawn_gets_the_tpu_dataset_by_value(spawns):
    cpu, tpu = spawns["loader"]
    assert tpu == cpu == [132.0, 420.0]
