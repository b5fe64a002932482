"""SIGHUP reloads a service's auth policy: a token added to the file is let in, one removed is
refused, and a file that does not parse leaves the policy in force (a real broker process)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc import aio

from sokutatsu.core.auth import hash_token
from sokutatsu.core.v1 import process_pb2, process_pb2_grpc
from tests.broker.fix_broker import BrokerProcess

RPC_SECONDS = 10.0
ADMIN, NEWCOMER = "token-of-the-admin-0123456789", "token-of-the-newcomer-0123456789"


def _policy(path: Path, *tokens: str) -> None:
    path.write_text(
        "\n".join(
            f'[principals.p{i}]\ntoken_sha256 = ["{hash_token(t)}"]\nadmin = true\n' for i, t in enumerate(tokens)
        )
    )


async def _answer(address: str, token: str) -> grpc.StatusCode:
    async with aio.insecure_channel(address) as channel:
        try:
            await process_pb2_grpc.ProcessStub(channel).GetProcessStats(
                process_pb2.GetProcessStatsRequest(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=RPC_SECONDS,
            )
        except aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _until(check: Callable[[], object], what: str) -> None:
    for _ in range(500):  # only stops a hung test; nothing is timed
        if await check():  # type: ignore[misc]
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


async def test_sighup_reloads_the_policy_and_a_bad_file_keeps_the_one_in_force(
    broker_factory: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    policy = tmp_path / "auth.toml"
    _policy(policy, ADMIN)
    broker = broker_factory()
    broker.env["SOKUTATSU_AUTH_FILE"] = str(policy)
    broker.start()
    assert broker.process is not None
    assert await _answer(broker.address, ADMIN) == grpc.StatusCode.OK
    assert await _answer(broker.address, NEWCOMER) == grpc.StatusCode.UNAUTHENTICATED

    async def newcomer_is(code: grpc.StatusCode) -> bool:
        return await _answer(broker.address, NEWCOMER) == code

    _policy(policy, ADMIN, NEWCOMER)
    broker.process.send_signal(signal.SIGHUP)
    await _until(lambda: newcomer_is(grpc.StatusCode.OK), "the added token to be let in")

    policy.write_text("[principals.broken\n")
    broker.process.send_signal(signal.SIGHUP)
    await _until(lambda: _async("auth policy not reloaded" in broker.log()), "the refusal to reload in the log")
    assert await _answer(broker.address, NEWCOMER) == grpc.StatusCode.OK

    _policy(policy, ADMIN)
    broker.process.send_signal(signal.SIGHUP)
    await _until(lambda: newcomer_is(grpc.StatusCode.UNAUTHENTICATED), "the removed token to be refused")
    assert broker.process.poll() is None
    assert "SOKUTATSU_AUTH_FILE" in broker.log()


async def _async(value: bool) -> bool:
    return value
