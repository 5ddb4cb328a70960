"""How a streaming client hears a stream: the model behind the stream-gap count.

A client plays audio as it arrives, from its first byte on. When what it holds has played out
before the next chunk comes, it waits (a gap: what a listener hears) and plays on from that
chunk. ``PlaybackClock`` follows that player from the sender's side: the service counts
``qtts_stream_gaps_total`` with it and ``bench/realtime.py`` its gaps after the first second.
"""

from __future__ import annotations


class PlaybackClock:
    """When the audio handed to a client so far has played out, for a player that waits."""

    def __init__(self) -> None:
        self.end: float | None = None  # None: nothing handed over yet

    @property
    def started(self) -> bool:
        return self.end is not None

    def wait(self, now: float) -> float:
        """Seconds the player has been waiting at ``now`` (0.0: it still has audio to play).
        A wait ends at ``now``: what is handed over next plays from then."""
        if self.end is None or now <= self.end:
            return 0.0
        waited = now - self.end
        self.end = now
        return waited

    def hand_over(self, now: float, seconds: float) -> None:
        """``seconds`` more audio reach the player at ``now`` (the first starts its clock)."""
        self.end = (now if self.end is None else self.end) + seconds
