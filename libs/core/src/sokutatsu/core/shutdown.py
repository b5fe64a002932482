"""A watchdog for a service's graceful stop: it names what the stop is waiting for.

A stop that overruns its grace period (a background task that does not end when
cancelled, a close that waits on the network) otherwise ends in the launcher's
SIGKILL with nothing in the log to say why. :func:`watch_stop` logs, once the
stop has taken ``after`` seconds, the stack of every task still pending.
:func:`stop_if_cancelled` is what keeps background loops from being that task.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

STACK_FRAMES = 12


def pending_stacks(loop: asyncio.AbstractEventLoop) -> list[str]:
    """The stack of every unfinished task of ``loop`` but the caller's, one string each."""
    current = asyncio.current_task(loop)
    stacks = []
    for task in asyncio.all_tasks(loop):
        if task.done() or task is current:
            continue
        # Frame by frame rather than Task.print_stack: a frame suspended in compiled code
        # (grpc's) can have no line number, which print_stack fails on.
        lines = [f"task {task.get_name()}: {task.get_coro()!r}"]
        lines += [
            f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            for frame in task.get_stack(limit=STACK_FRAMES)
        ]
        stacks.append("\n".join(lines))
    return stacks


def watch_stop(what: str, after: float) -> asyncio.TimerHandle:
    """Log the pending tasks if the stop of ``what`` still runs ``after`` seconds from now.

    Cancel the returned handle once the stop is done.
    """
    loop = asyncio.get_running_loop()

    def overran() -> None:
        stacks = pending_stacks(loop)
        log.warning("%s: still stopping after %.1fs; %d tasks pending", what, after, len(stacks))
        for stack in stacks:
            log.warning("%s", stack)

    return loop.call_later(after, overran)


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop.

    A service's background loop that catches gRPC errors calls it once per turn (the SDK's
    loops need not: ``close()`` sets their ``_closed`` flag before it cancels them). A
    cancellation can be lost on its way in: grpc.aio may end the call it interrupted with an
    ``AioRpcError`` (which the loop catches as one more failed call) instead of
    ``CancelledError``, and the loop would go on forever while the service waits for it to
    stop. ``Task.cancelling()`` still counts the request.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
