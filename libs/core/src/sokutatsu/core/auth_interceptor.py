"""The server side of auth: one interceptor that authenticates and authorises every call.

Installed by the shared bootstrap (:mod:`sokutatsu.core.server`) only when
``SOKUTATSU_AUTH_FILE`` is set, so with auth off nothing changes. For each RPC but health and
reflection it finds the principal (bearer token, else mTLS certificate common name), refuses
with ``UNAUTHENTICATED`` when there is none, and checks the method's rule
(:mod:`sokutatsu.core.auth_rules`) on the request, or on each frame of a request stream as
the servicer reads it, refusing with ``PERMISSION_DENIED``.

Each refusal is logged once per (principal or peer host, method) and counted in
:attr:`AuthInterceptor.violations` (by status code): the log line reports the total, and the
bootstrap hands :meth:`AuthInterceptor.refusals` to the service (the broker's ``BrokerStats``).
"""

from __future__ import annotations

import collections
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from sokutatsu.core.auth import ADMIN, FILE_VAR, TOKEN_VAR, Policy, Principal
from sokutatsu.core.auth_rules import RULES, Check, Rule, is_open
from sokutatsu.core.errors import PermissionDenied, echo
from sokutatsu.core.interceptors import Undecodable, rewrap
from sokutatsu.core.request_budget import Oversize

log = logging.getLogger(__name__)

_Behavior = Callable[..., Any]
_Context = aio.ServicerContext[Any, Any]
# How many distinct (who, method) refusals are remembered for logging once each.
LOGGED_LIMIT = 10_000

MISSING = (
    "this call needs credentials: send 'authorization: Bearer <token>' metadata ({token} in the environment, "
    "or token= in the SDK) or a client certificate whose name the server's {file} lists"
)
WRONG = (
    "the bearer token is not one the server knows (its SHA-256 is not in the server's {file}); "
    "make one with `sokutatsu auth token` and add its hash to a principal"
)


def _bearer(context: _Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _common_names(context: _Context) -> list[str]:
    names = context.auth_context().get("x509_common_name", [])
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


class AuthInterceptor(aio.ServerInterceptor):
    """Authenticates and authorises every call against ``policy``."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.violations: collections.Counter[str] = collections.Counter()
        self._logged: set[tuple[str, str]] = set()

    def refusals(self) -> int:
        """Calls refused so far, whatever the code."""
        return sum(self.violations.values())

    # ----------------------------------------------------------- decisions --

    async def _refuse(
        self, context: _Context, code: grpc.StatusCode, who: str, method: str, message: str, *, in_stream: bool = False
    ) -> NoReturn:
        """Count and log the refusal, then end the call with it. ``in_stream``: a frame of a request
        stream, refused as the servicer reads it: raised to the servicer (``PermissionDenied``), which
        ends its stream as it ends it for any error, its own clean-up first (a delivery worker tells the
        broker before its client sees the end), rather than sent to the client at once by ``abort``."""
        self.violations[code.name] += 1
        key = (who, method)
        if key not in self._logged and len(self._logged) < LOGGED_LIMIT:
            self._logged.add(key)
            log.warning(
                "auth: %s refused %s to %s: %s (auth refusals so far: %d)",
                code.name,
                method,
                who,
                message,
                self.refusals(),
            )
        if in_stream:
            raise PermissionDenied(message)
        await context.abort(code, message)

    async def authenticate(self, context: _Context, method: str) -> Principal:
        token = _bearer(context)
        peer = context.peer().rpartition(":")[0] or context.peer()
        if token is not None:
            principal = self.policy.by_token_value(token) if token else None
            if principal is None:
                await self._refuse(
                    context, grpc.StatusCode.UNAUTHENTICATED, f"peer {peer}", method, WRONG.format(file=FILE_VAR)
                )
            return principal
        for name in _common_names(context):
            principal = self.policy.by_cn.get(name)
            if principal is not None:
                return principal
        return await self._refuse(
            context,
            grpc.StatusCode.UNAUTHENTICATED,
            f"peer {peer}",
            method,
            MISSING.format(token=TOKEN_VAR, file=FILE_VAR),
        )

    async def check(
        self, context: _Context, principal: Principal, method: str, rule: Rule, want: Check, *, in_stream: bool = False
    ) -> None:
        permission, resource, subscriber = want
        if rule.admin_too and principal.may(ADMIN):
            return
        if not principal.may(permission, resource):
            target = f" on {echo(resource)}" if resource is not None else ""
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"principal {principal.name}",
                method,
                f"principal {principal.name!r} has no {permission!r} permission{target} "
                f"(grants are in the server's {FILE_VAR})",
                in_stream=in_stream,
            )
        if subscriber is not None and not principal.owns(subscriber):
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"principal {principal.name}",
                method,
                f"subscriber id {echo(subscriber)} does not belong to principal {principal.name!r}: its subscriber ids "
                f"are its name or start with one of its subscriber_prefixes {list(principal.subscriber_prefixes)}",
                in_stream=in_stream,
            )

    async def admit(self, request: Any, context: _Context, method: str) -> Principal:
        """Authenticate, then check the rule on a whole request (``None`` for a request stream)."""
        principal = await self.authenticate(context, method)
        rule = RULES.get(method)
        if rule is None:
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"principal {principal.name}",
                method,
                f"{method} has no authorisation rule, so nobody may call it",
            )
        if isinstance(request, (Undecodable, Oversize)):
            request = None  # checked as a stream's opening is; the servicer's guard refuses it (INVALID_ARGUMENT)
        resource = rule.resource(request) if rule.resource is not None and request is not None else None
        subscriber = rule.subscriber(request) if rule.subscriber is not None and request is not None else None
        await self.check(context, principal, method, rule, (rule.permission, resource, subscriber))
        return principal

    async def frames(
        self, requests: AsyncIterator[Any], context: _Context, principal: Principal, method: str
    ) -> AsyncIterator[Any]:
        """The request stream, each frame checked before the servicer sees it."""
        rule = RULES[method]
        checker = rule.frame
        allowed: set[Check] = set()
        async for frame in requests:
            for want in checker(frame) if checker is not None else ():
                if want not in allowed:
                    await self.check(context, principal, method, rule, want, in_stream=True)
                    if len(allowed) < LOGGED_LIMIT:
                        allowed.add(want)
            yield frame

    # ------------------------------------------------------------- wrapping --

    def _wrap(self, behavior: _Behavior, method: str, request_stream: bool) -> _Behavior:
        if inspect.isasyncgenfunction(behavior):

            async def streamed(request: Any, context: _Context) -> AsyncIterator[Any]:
                principal = await self.admit(None if request_stream else request, context, method)
                if request_stream:
                    request = self.frames(request, context, principal, method)
                async for item in behavior(request, context):
                    yield item

            return streamed

        async def unary(request: Any, context: _Context) -> Any:
            principal = await self.admit(None if request_stream else request, context, method)
            if request_stream:
                request = self.frames(request, context, principal, method)
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result

        return unary

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or is_open(method):
            return handler
        return rewrap(handler, lambda behavior, request_stream: self._wrap(behavior, method, request_stream))
