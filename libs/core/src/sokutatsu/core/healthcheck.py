"""``python -m sokutatsu.core.healthcheck host:port [service ...]``: one gRPC health check, as an exit status.

For container health checks (docker-compose.yml runs it in every service's
container, so the image needs no ``grpc_health_probe`` download). It asks the
server as a whole (``""``) and each named service whether it is SERVING:

* exit 0 when every answer is SERVING (nothing is printed);
* exit 1 otherwise, with one line on stderr per problem, e.g.
  ``healthcheck: broker-a:7201: NOT_SERVING`` or
  ``healthcheck: broker-a:7201: no answer within 2s (is the service listening there?)``;
* exit 2 for a malformed command line (argparse's usage message).

A wildcard host (``0.0.0.0``, ``[::]``) is asked on 127.0.0.1, as a server
listening there announces itself.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from sokutatsu.core.health import check
from sokutatsu.core.settings import SettingsError, parse_address, parse_positive_float

WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")  # noqa: S104 - hosts to translate, nothing is bound


def _address(raw: str) -> str:
    try:
        address = parse_address(raw)
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else address


def _seconds(raw: str) -> float:
    try:
        return parse_positive_float(raw)
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sokutatsu.core.healthcheck",
        description="Exit 0 when the gRPC server at ADDRESS (and each SERVICE) reports SERVING on gRPC health.",
    )
    parser.add_argument("address", type=_address, metavar="ADDRESS", help="host:port of the gRPC server")
    parser.add_argument("services", nargs="*", metavar="SERVICE", help="full gRPC service names to check as well")
    parser.add_argument(
        "--timeout", type=_seconds, default=2.0, help="seconds to wait for each answer (default: %(default)s)"
    )
    return parser


async def problems(address: str, services: Sequence[str], rpc_timeout: float) -> list[str]:
    """One line per service (``""`` = the server) that does not report SERVING; empty when healthy."""
    found = []
    for service in ("", *services):
        status = await check(address, service, rpc_timeout=rpc_timeout)
        if status == "SERVING":
            continue
        what = f"{address} {service}" if service else address
        if status == "UNREACHABLE":
            found.append(f"{what}: no answer within {rpc_timeout:g}s (is the service listening there?)")
            # Nothing else will answer either.
            break
        found.append(f"{what}: {status}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    found = asyncio.run(problems(args.address, args.services, args.timeout))
    for line in found:
        sys.stderr.write(f"healthcheck: {line}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
