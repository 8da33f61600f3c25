"""Hand-over counters (Note [hand-over flags], runtime/handover.py) as a CPU "device" uses them."""
import threading
import time

import torch

from rpcompile.runtime.device import DeviceRuntime
from rpcompile.runtime.handover import Flagged, HandoverFlags, reached


def test_counters_compare_modulo_two_to_the_32():
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(3, 0xFFFFFFFE)              # wrapped past 2**32: still later
    assert not reached(0xFFFFFFFE, 3)


def test_a_reader_waits_for_the_producers_counter():
    table = torch.tensor([-1, 0], dtype=torch.int32)    # the producer's counter at 2**32 - 1: the next wraps
    producer, consumer = HandoverFlags(table, 0, torch.device("cpu")), HandoverFlags(table, 1, torch.device("cpu"))
    assert producer.number == 0xFFFFFFFF
    data = torch.zeros(3)
    value = Flagged(data, consumer, 0, (producer.number + 1) & 0xFFFFFFFF)
    assert not consumer.landed(0, value.number)

    def produce():
        time.sleep(0.05)
        data.fill_(7.0)
        producer.signal(None)
    t = threading.Thread(target=produce)
    t.start()
    # a CPU device's upload resolves the value: it sees the data, never the zeros
    got = DeviceRuntime(torch.device("cpu")).upload(value)
    t.join()
    assert torch.equal(got, torch.full((3,), 7.0)) and producer.number == 0
