"""A watchdog for a service's graceful stop: it names what the stop is waiting for.

A stop that overruns its grace period (a background task that does not end when
cancelled, a close that waits on the network) otherwise ends in the launcher's
SIGKILL with nothing in the log to say why. :func:`watch_stop` logs, once the
stop has taken ``after`` seconds, the stack of every task still pending.
"""

from __future__ import annotations

import asyncio
import io
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
        text = io.StringIO()
        task.print_stack(limit=STACK_FRAMES, file=text)
        stacks.append(text.getvalue().rstrip())
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
