"""Background loops that slow down while nothing happens and come back at the first sign of work."""

from __future__ import annotations

from api.pressure import QueueMonitor, Snapshot, _moving
from stoker.core.pacing import Pace
from stoker.core.pressure import QueueState
from stoker.settings import ApiSettings
from tests.fakes.store import MemoryStore


def test_a_pace_slows_while_idle_up_to_its_cap_and_snaps_back_on_activity() -> None:
    pace = Pace(base_s=0.25, max_s=2.0)
    assert [pace.next_wait(active=False) for _ in range(5)] == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert pace.slowed
    assert pace.next_wait(active=True) == 0.25
    assert not pace.slowed
    pace.next_wait(active=False)
    pace.reset()
    assert pace.wait_s == 0.25
    assert Pace(base_s=3.0, max_s=1.0).next_wait(active=False) == 3.0  # a cap below the own pace is that pace


def _snapshot(*depths: int) -> Snapshot:
    return Snapshot(0.0, [QueueState(f"q{n}", depth, 10, 0.0) for n, depth in enumerate(depths)])


def test_the_queue_monitor_sees_work_in_waiting_or_moving_queues() -> None:
    assert not _moving(_snapshot(0, 0), _snapshot(0, 0))
    assert _moving(_snapshot(0, 0), _snapshot(0, 1))  # something waits
    assert _moving(_snapshot(0, 3), _snapshot(0, 0))  # it just drained
    assert _moving(None, _snapshot(0, 0))  # no sample before
    assert _moving(_snapshot(0, 0), None)  # a failed sample: keep trying at the own pace


def test_a_submission_brings_a_slowed_queue_monitor_back_to_its_pace() -> None:
    monitor = QueueMonitor(ApiSettings(idle_max_wait_s=4.0), store=MemoryStore.empty(), interval_s=0.5, stale_s=5.0)
    assert monitor.pace.max_s == 2.5  # half the staleness: admission never acts on queue depths too old
    for _ in range(4):
        monitor.pace.next_wait(active=False)
    assert monitor.pace.slowed
    monitor.touch()
    assert monitor.pace.wait_s == 0.5
