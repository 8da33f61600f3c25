"""DeviceRuntime's transfers on a CPU device: values go through unchanged in structure, a bare
tensor without pytree (the fast path) exactly like one inside a tuple."""
import torch

from rpcompile.runtime.device import DeviceRuntime, Pending, resolve
from rpcompile.runtime.job import nbytes

from parity import FakeEvent


def test_upload_and_download_keep_structure_and_dtypes():
    dev = DeviceRuntime(torch.device("cpu"))
    x, i = torch.randn(3, 4), torch.arange(5)
    assert dev.upload(x, torch.bfloat16).dtype == torch.bfloat16
    up = dev.upload((x, [i, None], {"k": x}), torch.bfloat16)
    assert up[0].dtype == torch.bfloat16 and up[1][0].dtype == torch.long and up[1][1] is None
    assert up[2]["k"].dtype == torch.bfloat16
    down = dev.download((x.requires_grad_(), 7))
    assert down[1] == 7 and not down[0].requires_grad and torch.equal(down[0], x)
    assert not dev.download(x).requires_grad


def test_resolve_and_nbytes_of_pending_values():
    t, ev = torch.ones(2, 3), FakeEvent()
    p = Pending(t, ev)
    assert resolve(p) is t and ev.waited == 1
    out = resolve((p, [p, 3], None))
    assert out[0] is t and out[1][0] is t and out[1][1] == 3 and out[2] is None and ev.waited == 3
    assert resolve(None) is None and resolve(t) is t
    assert nbytes(p) == nbytes(t) == 24 and nbytes((p, t, 5)) == 48
