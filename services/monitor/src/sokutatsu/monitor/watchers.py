"""``WatchAssignments`` fan-out: one bounded queue per watcher.

A watcher that falls ``WATCH_BUFFER`` changes behind is told once (its stream ends with
RESOURCE_EXHAUSTED) instead of making the monitor hold an ever longer backlog for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from sokutatsu.monitor.v1 import monitor_pb2

WATCH_BUFFER = 10_000


class Watch:
    def __init__(self, subscriber_id: str) -> None:
        self.subscriber_id = subscriber_id
        # None: the watcher fell behind.
        self.queue: asyncio.Queue[monitor_pb2.Assignment | None] = asyncio.Queue(maxsize=WATCH_BUFFER)
        self.overflowed = False

    def wants(self, assignment: monitor_pb2.Assignment) -> bool:
        return not self.subscriber_id or assignment.subscriber_id == self.subscriber_id

    def offer(self, assignment: monitor_pb2.Assignment) -> None:
        if self.overflowed or not self.wants(assignment):
            return
        try:
            self.queue.put_nowait(assignment)
        except asyncio.QueueFull:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


class Watchers:
    def __init__(self) -> None:
        self._watches: set[Watch] = set()

    def __len__(self) -> int:
        return len(self._watches)

    @contextlib.contextmanager
    def open(self, subscriber_id: str) -> Iterator[Watch]:
        watch = Watch(subscriber_id)
        self._watches.add(watch)
        try:
            yield watch
        finally:
            self._watches.discard(watch)

    def publish(self, assignment: monitor_pb2.Assignment) -> None:
        for watch in list(self._watches):
            watch.offer(assignment)
