"""Finishing switchovers whose step 4 (release) the serving broker refused.

A broker refuses to release a subscriber's queue while it does not hear its peer (to keep
the data). Each round the monitor looks again: once the source hears the target, it
releases; if the target is gone instead, the source takes the subscriber back
(``AcceptSubscriber`` with the switch position: it still holds everything after it).
A pending subscriber is not moved again until this is settled.
"""

from __future__ import annotations

import logging

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.assignments import SubKey
from sokutatsu.monitor.broker_link import rpc_error_text
from sokutatsu.monitor.host import KeeperHost
from sokutatsu.monitor.switchover import PendingRelease

log = logging.getLogger(__name__)
LEAVING = broker_pb2.QUEUE_STATE_LEAVING


class ReleaseKeeper:
    def __init__(self, monitor: KeeperHost) -> None:
        self.monitor = monitor
        self.pending: dict[SubKey, PendingRelease] = {}
        self.busy: set[SubKey] = set()  # being finished now

    def __contains__(self, key: SubKey) -> bool:
        return key in self.pending or key in self.busy

    def add(self, key: SubKey, pending: PendingRelease) -> None:
        self.pending[key] = pending

    def tick(self, now: float) -> None:
        for key, pending in list(self.pending.items()):
            if key in self.busy or key in self.monitor.running:
                continue
            source, target = self.monitor.links[pending.source_id], self.monitor.links[pending.target_id]
            if source.stats is None or not source.reachable(now):
                continue
            state = next((s.state for s in source.stats.subscribers if (s.subscriber_id, s.topic) == key), None)
            if state != LEAVING:
                del self.pending[key]  # finished (or undone) by someone else
                continue
            if not target.reachable(now):
                self.busy.add(key)
                self.monitor.spawn(self._give_back(key, pending), f"give-back-{pending.switchover_id}")
            elif source.stats.peer_up:
                self.busy.add(key)
                self.monitor.spawn(self._release(key, pending), f"release-{pending.switchover_id}")

    async def _release(self, key: SubKey, pending: PendingRelease) -> None:
        source = self.monitor.links[pending.source_id]
        try:
            await source.release(pending.switchover_id, *key)
        except Exception as exc:  # noqa: BLE001 - tried again next round
            log.debug("release of %s on %s still refused: %s", key, source.broker_id, rpc_error_text(exc))
        else:
            self.pending.pop(key, None)
            self._note(pending.switchover_id, f"step 4 done later on {source.broker_id}")
            log.info("switchover %s: step 4 (release) done on %s", pending.switchover_id, source.broker_id)
        finally:
            self.busy.discard(key)

    async def _give_back(self, key: SubKey, pending: PendingRelease) -> None:
        source = self.monitor.links[pending.source_id]
        try:
            await source.accept(pending.switchover_id, pending.subscription, pending.position)
        except Exception as exc:  # noqa: BLE001 - tried again next round
            log.warning("giving %s back to %s failed: %s", key, source.broker_id, rpc_error_text(exc))
        else:
            self.pending.pop(key, None)
            self._note(
                pending.switchover_id,
                f"{pending.target_id} stopped answering after the redirect; {source.broker_id} took the "
                "subscriber back",
            )
            log.warning("%s stopped answering; %s took %s on %s back", pending.target_id, source.broker_id, *key)
        finally:
            self.busy.discard(key)

    def _note(self, switchover_id: str, text: str) -> None:
        for record in self.monitor.recent:
            if record.id == switchover_id:
                record.note = f"{record.note}; {text}" if record.note else text
                return
