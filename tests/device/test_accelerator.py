"""torch.accelerator's memory functions and synchronize with tpu as the accelerator
(Note [torch.accelerator on tpu])."""

import torch

import torchjax  # noqa: F401


def test_memory_functions_answer_for_tpu():
    x = torch.ones(1024, device="tpu")
    torch.accelerator.synchronize()
    torch.accelerator.synchronize("tpu:0")
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_allocated() >= x.numel() * 4
    assert torch.accelerator.memory_allocated(0) == torch.tpu.memory_allocated(0)
    assert torch.accelerator.max_memory_allocated() >= torch.accelerator.memory_allocated() > 0
    assert torch.accelerator.memory_reserved() >= 0
    assert torch.accelerator.max_memory_reserved() >= 0
    assert isinstance(torch.accelerator.memory_stats(), dict)
    free, total = torch.accelerator.get_memory_info()
    assert (free, total) == torch.tpu.mem_get_info()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    torch.accelerator.memory.empty_cache()  # the module torch defines them in


def test_accelerate_clears_the_device_cache_when_moving_weights():
    # accelerate 1.16 calls torch.accelerator.empty_cache() from every weight move.
    from accelerate.utils import set_module_tensor_to_device
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache(garbage_collection=True)
    m = torch.nn.Linear(2, 2, device="meta")
    set_module_tensor_to_device(m, "weight", "tpu", value=torch.ones(2, 2))
    assert m.weight.device.type == "tpu"
    assert torch.equal(m.weight.cpu(), torch.ones(2, 2))
