"""Fake tpu tensors under torch.compile: inputs that are views compile and equal CPU."""

import pytest
import torch

import torchjax

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _packed(x):
    # diffusers' LTX-2 latent packing: a size-1 leading dimension through a permute.
    return (
        x.reshape(1, -1, 3, 1, 4, 1, 4, 1)
        .permute(0, 2, 4, 6, 1, 3, 5, 7)
        .flatten(4, 7)
        .flatten(1, 3)
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: x.flatten()[0].expand(1), id="expand_of_0d"),
        pytest.param(lambda x: x.flatten()[0].expand(1, 3), id="expand_of_0d_to_2d"),
        pytest.param(_packed, id="size_1_dim_through_permute"),
    ],
)
def test_a_view_input_compiles_with_the_strides_eager_gives(make):
    # Note [Fake views take eager strides]: Dynamo replays an input view's chain on the
    # fake base and compares strides with the real tensor's, size-1 dimensions included.
    x = torch.randn(1, 2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    cpu_in, tpu_in = make(x), make(x.to("tpu"))
    assert tpu_in._is_view() and tpu_in.stride() == cpu_in.stride()
    fn = torch.compile(lambda t: t * 2 + 1, backend="tpu", fullgraph=True, dynamic=False)
    before = torchjax.compile.dynamo_stats()
    torch.testing.assert_close(fn(tpu_in).cpu(), cpu_in * 2 + 1)
    torch.testing.assert_close(fn(make(x.to("tpu"))).cpu(), cpu_in * 2 + 1)
    after = torchjax.compile.dynamo_stats()
    assert after["graphs"] - before["graphs"] == 1


def test_views_made_inside_a_graph_still_match_cpu():
    # Views made while tracing take ATen's strides too (the same rule as inputs').
    x = torch.randn(1, 2, 3, 4, 4, generator=torch.Generator().manual_seed(1))

    def fn(t):
        v = _packed(t)
        return v.transpose(1, 2).contiguous() + t.flatten()[0].expand(2, 1)

    compiled = torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), fn(x))


def _halves(x):
    return x[:2].detach(), x[2:].detach()


def _overlapping(x):
    return x[:4].detach(), x[2:].detach()


def _rows_and_columns(x):
    x = x.reshape(2, 3)
    return x[1:].detach(), x[:, 1:].t().detach()


def _write_then_read(a, b):
    a.add_(1)
    return b * 2, a.sum()


@pytest.mark.parametrize(
    "split, fn",
    [
        pytest.param(_halves, lambda a, b: a * 2 + b.sum(), id="disjoint"),
        pytest.param(_overlapping, _write_then_read, id="overlapping_written"),
        pytest.param(_rows_and_columns, lambda a, b: (a.sum(0), b @ b), id="2d"),
        pytest.param(lambda x: (x[2:].detach(),), lambda b: b + 1, id="one_at_an_offset"),
    ],
)
def test_inputs_sharing_a_storage_compile_and_equal_cpu(split, fn):
    # Note [Inputs sharing a storage]: inputs that are not views but share one storage
    # (or sit at an offset of theirs) are faked with ``set_``; torch.compile raised
    # InternalTorchDynamoError on them.
    x = torch.arange(6.0)
    cpu_in, tpu_in = split(x.clone()), split(x.to("tpu"))
    assert not any(t._is_view() for t in tpu_in)
    assert all(
        t.untyped_storage().data_ptr() == tpu_in[0].untyped_storage().data_ptr() for t in tpu_in
    )
    expected = fn(*cpu_in)
    got = torch.compile(fn, backend="tpu", fullgraph=True)(*tpu_in)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected) > 0
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
    for g, e in zip(tpu_in, cpu_in):  # the inputs, written in place where fn writes
        assert torch.equal(g.cpu(), e)


def test_parameters_over_one_flat_buffer_train_as_on_cpu():
    # Parameters made over one flat buffer (as ZeRO-style flattening does) compile
    # into a training step, gradients and an optimizer step equal to CPU's.
    flat = torch.randn(15, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))

    def run(device, compiled):
        buf = flat.clone().to(device)  # on CPU, .to would share flat itself
        w = torch.nn.Parameter(buf[:12].view(4, 3).detach())
        b = torch.nn.Parameter(buf[12:].detach())
        opt = torch.optim.SGD([w, b], lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = (x @ w + b).square().sum()
            loss.backward()
            return loss

        fn = torch.compile(step, backend="tpu") if compiled else step
        losses = [fn(x.to(device)).item() for _ in range(2)]
        opt.step()
        return losses, w.grad.cpu(), b.grad.cpu(), w.detach().cpu(), b.detach().cpu()

    cpu, tpu = run("cpu", False), run("tpu", True)
    torch.testing.assert_close(tpu[0], cpu[0])
    for t, c in zip(tpu[1:], cpu[1:]):
        torch.testing.assert_close(t, c)


@pytest.mark.parametrize("shape", [(2, 400), (400,)])
def test_a_composite_that_changes_a_layout_in_place_gives_its_eager_shape(shape):
    # Note [In-place layout changes of fakes]: stft's composite ends in
    # ``out.transpose_(1, 2)`` (and ``out.squeeze_(0)`` for a 1-d signal); Dynamo read
    # the result's shape before those.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    window = torch.hann_window(64)

    def fn(x, w):
        s = torch.stft(x, 64, window=w, return_complex=True)
        return s.shape, s.abs().sum(dim=-1)

    got_shape, got = torch.compile(fn, backend="tpu", fullgraph=True)(x.to("tpu"), window.to("tpu"))
    want_shape, want = fn(x, window)
    assert got_shape == want_shape
    torch.testing.assert_close(got.cpu(), want)
