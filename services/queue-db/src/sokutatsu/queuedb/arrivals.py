"""The ``Enqueue`` and ``Ack`` calls inside the service on their way to a group commit: a group waits
for them, up to its window, only while there are some (PostgreSQL's ``commit_siblings``, counted
exactly), so a lone call never waits (:mod:`sokutatsu.queuedb.group_commit`). A call holds a
:class:`Ticket` from the moment its handler starts until it joins a group or its handler ends.
"""

from __future__ import annotations


class Arrivals:
    """How many ``Enqueue`` and ``Ack`` calls are inside the service and have not joined a group yet:
    a group waits for them (up to its window) only while there are some."""

    def __init__(self) -> None:
        self.coming = 0

    def ticket(self) -> Ticket:
        return Ticket(self)


class Ticket:
    """One call on its way to a group; closed when it joins one, or when its handler ends without."""

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._open = True
        arrivals.coming += 1

    def close(self) -> None:
        if self._open:
            self._open = False
            self._arrivals.coming -= 1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
