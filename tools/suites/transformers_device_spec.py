"""transformers' test device spec for torchjax (`TRANSFORMERS_TEST_DEVICE_SPEC`).

testing_utils imports this file by name and maps its `*_FN` entries into the `backend_*`
helpers the tests call (seeding, cache emptying, device count).
"""

import torch

import torchjax  # noqa: F401  registers the "tpu" device

DEVICE_NAME = "tpu"
MANUAL_SEED_FN = torch.manual_seed
EMPTY_CACHE_FN = torch.tpu.empty_cache
DEVICE_COUNT_FN = torch.tpu.device_count
