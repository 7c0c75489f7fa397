"""torchjax/device/_generator.py: torch.Generator(device="tpu")."""

import copy
import pickle

import torch

import torchjax  # noqa: F401


def test_a_tpu_generator_seeds_tpu_draws_as_a_cpu_generator():
    gen = torch.Generator(device="tpu").manual_seed(0)
    assert gen.device == torch.device("tpu", 0)
    assert torch.Generator("tpu:0").device == torch.device("tpu", 0)
    cpu = torch.Generator().manual_seed(0)
    draws = [
        (lambda g, d: torch.randn(5, generator=g, device=d)),
        (lambda g, d: torch.empty(4, device=d).uniform_(generator=g)),
        (lambda g, d: torch.randint(0, 9, (6,), generator=g, device=d)),
    ]
    for draw in draws:
        got, want = draw(gen, "tpu"), draw(cpu, "cpu")
        assert got.device.type == "tpu"
        assert torch.equal(got.cpu(), want)
    assert gen.initial_seed() == 0
    assert torch.equal(gen.get_state(), cpu.get_state())


def test_torch_generators_are_still_torch_generators():
    assert isinstance(torch.default_generator, torch.Generator)
    assert isinstance(torch.Generator(), torch.Generator)
    assert torch.Generator().device == torch.device("cpu")
    assert issubclass(torch._C.Generator, torch.Generator)


def test_copies_and_pickles_stay_on_their_device():
    gen = torch.Generator("tpu").manual_seed(3)
    torch.randn(2, generator=gen, device="tpu")
    for clone in (copy.deepcopy(gen), pickle.loads(pickle.dumps(gen))):
        assert clone.device == torch.device("tpu", 0)
        assert torch.equal(clone.get_state(), gen.get_state())
    cpu = copy.deepcopy(torch.Generator().manual_seed(5))
    assert cpu.device == torch.device("cpu") and cpu.initial_seed() == 5
