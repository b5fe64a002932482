"""Sequencer process wiring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.unserved import add_unimplemented
from sokutatsu.sequencer.settings import SequencerSettings
from sokutatsu.sequencer.v1 import sequencer_pb2

SERVICES = [sequencer_pb2.DESCRIPTOR.services_by_name["Sequencer"]]


def build(settings: SequencerSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        return add_unimplemented(server, SERVICES, "the sequencer arrives with issue #6")

    return register


def main() -> NoReturn:
    run_service("sequencer", SequencerSettings, build)
