"""The monitor's gRPC servicer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from sokutatsu.monitor.monitor import Monitor
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

SERVICE = "sokutatsu.monitor.v1.Monitor"


class MonitorService(monitor_pb2_grpc.MonitorServicer):
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    async def GetStatus(
        self, request: monitor_pb2.GetStatusRequest, context: aio.ServicerContext[Any, Any]
    ) -> monitor_pb2.MonitorStatus:
        return self.monitor.status(request.recent_switchovers)

    async def GetAssignment(
        self, request: monitor_pb2.GetAssignmentRequest, context: aio.ServicerContext[Any, Any]
    ) -> monitor_pb2.Assignment:
        return self.monitor.assignment(request.subscriber_id, request.topic)

    async def WatchAssignments(
        self, request: monitor_pb2.WatchAssignmentsRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[monitor_pb2.Assignment]:
        async for assignment in self.monitor.watch(request.subscriber_id):
            yield assignment

    async def RequestSwitchover(
        self, request: monitor_pb2.RequestSwitchoverRequest, context: aio.ServicerContext[Any, Any]
    ) -> monitor_pb2.Switchover:
        return await self.monitor.request_switchover(request.subscriber_id, request.topic, request.to_broker_id)
