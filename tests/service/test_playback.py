"""The player behind the stream-gap count (service/playback.py)."""

from __future__ import annotations

import pytest

from service.playback import PlaybackClock


def feed(arrivals: list[tuple[float, float]]) -> tuple[list[float], PlaybackClock]:
    """Hand over (time, seconds) chunks in order; the wait seen before each."""
    clock = PlaybackClock()
    waits = []
    for now, seconds in arrivals:
        waits.append(clock.wait(now))
        clock.hand_over(now, seconds)
    return waits, clock


def test_a_stream_ahead_of_playback_never_waits() -> None:
    waits, clock = feed([(10.0, 1.0), (10.5, 1.0), (11.9, 1.0), (12.9, 2.0)])
    assert waits == [0.0, 0.0, 0.0, 0.0]
    assert clock.end == pytest.approx(15.0)  # 5 s of audio from 10.0 on


def test_one_late_chunk_is_one_gap_and_playback_resumes_there() -> None:
    # 1 s played out at 11.0; the next chunk comes at 11.5: a 0.5 s wait, then it plays to
    # 12.5, so a chunk at 12.4 is in time, though it is late against the first byte's clock
    waits, clock = feed([(10.0, 1.0), (11.5, 1.0), (12.4, 1.0), (13.6, 1.0)])
    assert waits == [0.0, pytest.approx(0.5), 0.0, pytest.approx(0.1)]
    assert clock.end == pytest.approx(14.6)


def test_before_the_first_chunk_nobody_waits() -> None:
    clock = PlaybackClock()
    assert not clock.started and clock.wait(1e9) == 0.0
    clock.hand_over(5.0, 0.25)
    assert clock.started and clock.wait(5.25) == 0.0 and clock.wait(5.5) == pytest.approx(0.25)
