"""examples/launch_multiprocess.py: examples/tp_generate.py with TP=8 across 2
jax.distributed processes (4 CPU devices each, gloo collectives): both processes print
the greedy tokens of the single-process CPU PyTorch run of the same model, and the same
logits checksum (to float32 rounding)."""

import re

from examples import tp_generate


def _parse(line):
    tokens, logits_sum = re.fullmatch(r"tokens=(\[.*\]) logits_sum=(\S+)", line).groups()
    return tokens, float(logits_sum)


def test_two_processes_match_single_process(sharding_runs):
    code, out = sharding_runs["multi"]
    assert code == 0, out[-6000:]
    lines = dict(re.findall(r"^\[(\d)\] process \d/2: (.*)$", out, flags=re.M))
    assert set(lines) == {"0", "1"}, out[-6000:]
    assert lines["0"] == lines["1"]
    tokens, logits_sum = _parse(lines["0"])
    ref_tokens, ref_sum = _parse(tp_generate.run(tp=0, new_tokens=2))
    assert tokens == ref_tokens
    assert abs(logits_sum - ref_sum) < 2e-3, (logits_sum, ref_sum)
