"""Host working copies (runtime/weights.py): rewritten only when a parameter changed, never
while an upload reads them, with one wait per stream and one copy call for many parameters."""
import torch

from rpcompile.runtime.weights import DelayedWeights, HostWeights, upload_mark, wait_for_uploads

from parity import FakeEvent


def test_only_the_newest_upload_of_each_stream_is_waited_on():
    events = [FakeEvent() for _ in range(5)]
    marks = [upload_mark(events[0], "s0"), upload_mark(events[1], "s1"), upload_mark(events[2], "s0"),
             upload_mark(events[3], "s1"), upload_mark(None, "s2")]
    wait_for_uploads(list(reversed(marks)))
    assert [e.waited for e in events[:4]] == [0, 0, 1, 1]


def test_refresh_many_rewrites_changed_copies_only():
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    hw = HostWeights(pin=False)
    copies, events = [], []
    for p in params:
        with hw.refreshed(p, torch.bfloat16) as entry:
            events.append(FakeEvent())
            hw.mark_upload(entry, events[-1], "stream")
            copies.append(entry)
    with torch.no_grad():
        params[0].add_(1.0)
        params[2].mul_(2.0)
    before = copies[1][1].clone()
    hw.refresh_many(params, torch.bfloat16)
    for p, entry in zip(params, copies):
        assert torch.equal(entry[1], p.detach().to(torch.bfloat16))
        assert entry[0] == p._version
    assert torch.equal(copies[1][1], before)
    assert events[2].waited == 1 and events[0].waited == 0   # the newest upload only


def test_delayed_write_many_goes_to_one_slot():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    dw = DelayedWeights(params + [frozen], torch.bfloat16, pin=False)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    dw.write_many(params, 1)
    for p in params:
        slots = dw._copies[id(p)]
        assert torch.equal(slots[1][0], p.detach().to(torch.bfloat16))
        assert not torch.equal(slots[0][0], slots[1][0])
    assert dw._copies[id(frozen)][0] is dw._copies[id(frozen)][1]


def test_rows_of_a_parameter_are_views_of_its_one_copy():
    """A tied embedding is uploaded whole by one job and by vocabulary rows by others: one copy,
    rows of it, refreshed as one when the parameter moves; a stream's newer upload replaces its
    older mark, and a rewrite waits for the newest upload of every stream that read the copy."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    hw = HostWeights(pin=False)
    events = [FakeEvent() for _ in range(3)]
    with hw.refreshed(p, torch.bfloat16) as whole:
        hw.mark_upload(whole, events[0], "s0")
    with hw.refreshed(p, torch.bfloat16, rows=(2, 4)) as part:
        assert part[1].data_ptr() == whole[1][2:4].data_ptr() and torch.equal(part[1], p.detach()[2:4].bfloat16())
        hw.mark_upload(part, events[1], "s0")
    with hw.refreshed(p, torch.bfloat16, rows=(4, 6)) as part:
        hw.mark_upload(part, events[2], "s1")
    assert [m[2] for m in whole[2]] == [events[1], events[2]]
    assert hw.nbytes() == p.numel() * 2
    with torch.no_grad():
        p.mul_(3.0)
    with hw.refreshed(p, torch.bfloat16, rows=(0, 2)) as part:
        assert torch.equal(whole[1], p.detach().bfloat16())
    assert [e.waited for e in events] == [0, 1, 1]
