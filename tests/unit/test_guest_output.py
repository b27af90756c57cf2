"""The kernel's stream patch (guest/output.py): no IOPub message grows past its bound, whatever the writes."""

from __future__ import annotations

from coderunner.guest import output


class Stream:
    """Records what a patched stream passes on: each write, and a mark at each flush."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def write(self, text: str) -> int:
        self.events.append(len(text))
        return len(text)

    def flush(self) -> None:
        self.events.append("flush")


def _largest_between_flushes(events: list[object]) -> int:
    largest = current = 0
    for event in events:
        if event == "flush":
            current = 0
        else:
            assert isinstance(event, int)
            current += event
            largest = max(largest, current)
    return largest


def test_many_small_writes_are_flushed_every_flush_chars() -> None:
    """A tight print loop must not pile up more than FLUSH_CHARS for one message when the timed flush lags."""
    stream = Stream()
    write = output._chunked(stream)
    for _ in range(10_000):
        assert write("x" * 1000) == 1000
    assert stream.events.count("flush") >= 10_000 * 1000 // output.FLUSH_CHARS
    assert _largest_between_flushes(stream.events) <= output.FLUSH_CHARS + 1000


def test_a_large_write_is_split_and_flushed_piece_by_piece() -> None:
    stream = Stream()
    assert output._chunked(stream)("y" * (3 * output.CHUNK_CHARS + 5)) == 3 * output.CHUNK_CHARS + 5
    assert _largest_between_flushes(stream.events) == output.CHUNK_CHARS
    assert [event for event in stream.events if event != "flush"] == [output.CHUNK_CHARS] * 3 + [5]
