"""Tier 1: the measurement's replay of a profile (``fsdp_pass.report.measure.replay``) on hand-made events.

gloo's worker thread sometimes frees a collective's buffer outside the profiler's view: the profile
then shows the allocation and no free. The replay puts that free at the collective's wait, but only
for a buffer that is gone by the end (a reduce-scatter's output that became a gradient is not), and
only once.
"""

from fsdp_pass.report.measure import MemoryEvent, _peak, replay


def alloc(address, nbytes, inside=False):
    return MemoryEvent("memory", address, nbytes, inside)


def free(address, nbytes, inside=False):
    return MemoryEvent("memory", address, -nbytes, inside)


def issued(n):
    return MemoryEvent("issued", collective=n)


def waited(n):
    return MemoryEvent("waited", collective=n)


# a send buffer (address 1, 100 B) handed to collective 0, then 200 B of compute after its wait
STEP = [alloc(1, 100), alloc(2, 10), issued(0), alloc(3, 50, inside=True), free(3, 50, inside=True), waited(0)]
AFTER = [alloc(4, 200), free(4, 200), free(2, 10)]


def peak_of(events, gone):
    step, group = replay(events, [[1, 2]], gone)
    return _peak(step), _peak(group)


def test_a_lost_free_is_put_at_the_wait():
    (peak, net), (group_peak, _) = peak_of(STEP + AFTER, gone=[{1, 2}])
    assert (peak, net, group_peak) == (210, 0, 50)  # not 310: the send buffer left at the wait


def test_a_buffer_alive_at_the_end_is_not_freed():
    (peak, net), _ = peak_of(STEP + AFTER, gone=[{2}])  # address 1 still held, e.g. as a gradient
    assert (peak, net) == (310, 100)


def test_a_seen_free_is_counted_once():
    (peak, net), _ = peak_of(STEP + [free(1, 100)] + AFTER, gone=[{1, 2}])
    assert (peak, net) == (210, 0)


def test_an_address_taken_again_frees_its_earlier_block():
    events = [alloc(7, 100), alloc(8, 30), alloc(7, 40), free(7, 40), free(8, 30)]
    step, _ = replay(events, [], [])
    assert _peak(step) == (130, 0)  # the first block at 7 was freed before 7 was allocated again


def test_a_block_from_before_the_window_frees_into_its_side():
    step, group = replay([free(9, 64), free(10, 32, inside=True), alloc(11, 8)], [], [])
    assert (step, group) == ([-64, 8], [-32])
