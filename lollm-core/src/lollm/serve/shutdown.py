"""How ``lollm serve`` stops: a graceful shutdown with a deadline (``--shutdown-timeout``, default 20 s).

On SIGTERM (what ``kill``, systemd and Kubernetes send) or SIGINT (Ctrl-C)::

    t = 0        the port closes (no new connection); an idle keep-alive connection is closed;
                 a request still arriving is answered 503 (code "server_shutting_down");
                 every request waiting in the queue is answered at once: 503, or, for a stream
                 that had begun, a last event whose finish_reason is "shutdown"
    0 .. T       running generations go on; the server exits as soon as none is left
    t = T        (the deadline) every generation still running is stopped: a stream ends with
                 a clean last chunk, finish_reason "shutdown", then ``data: [DONE]``; a request
                 that was not streamed gets a 503
    by T + 2 s   the answers are written and the process exits with status 0

A second Ctrl-C stops waiting (uvicorn's "force quit"). Why a deadline: a Kubernetes pod gets
30 s (``terminationGracePeriodSeconds``) between SIGTERM and SIGKILL; a process that waits for
every generation to end may take as long as the longest answer. vLLM ends a request stopped this
way with ``finish_reason: "abort"``; lollm names the cause, ``"shutdown"``.

:class:`DrainingServer` is uvicorn's ``Server`` with this shutdown; the requests' side (who is
queued, who runs, how each is ended) is :meth:`lollm.serve.model_server.ModelServer.begin_shutdown`
and :meth:`~lollm.serve.model_server.ModelServer.stop_all`, for every loaded model
(:class:`lollm.serve.models.ServedModels`). This module needs the ``serve`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Iterator

import uvicorn

from lollm.serve.models import ServedModels

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: Seconds ``lollm serve`` lets running requests go on after SIGTERM or SIGINT (``--shutdown-timeout``).
DEFAULT_SHUTDOWN_TIMEOUT = 20.0
#: Seconds, after the deadline, for the last answers to be written before the connections are dropped.
FLUSH_SECONDS = 1.5
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown lets requests run until a deadline, then ends them cleanly (exit 0).

    config:   the uvicorn Config.
    server:   the models (:class:`ServedModels`) whose requests are drained.
    deadline: seconds running requests may go on after the signal (``--shutdown-timeout``, >= 0).
    """

    def __init__(self, config: uvicorn.Config, server: ServedModels, deadline: float = DEFAULT_SHUTDOWN_TIMEOUT):
        super().__init__(config)
        self.model_server, self.deadline = server, deadline
        self.signalled: float | None = None  # time.monotonic() of the first SIGTERM / SIGINT

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.signalled is None:
            self.signalled = time.monotonic()
        super().handle_exit(sig, frame)

    def stopped_line(self) -> str | None:
        """The last log line: how long after the signal the server stopped (None: no signal stopped it)."""
        if self.signalled is None:
            return None
        return f"stopped {time.monotonic() - self.signalled:.2f} s after the signal (--shutdown-timeout {self.deadline:g})"

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM start the shutdown (:meth:`handle_exit`); unlike uvicorn's own, the signal is not
        raised again once the server has stopped, so a shutdown asked for by a signal exits 0, not 143."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, drain until the deadline (:meth:`drain`), then uvicorn's shutdown with a short flush."""
        for listener in self.servers:
            listener.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # closes an idle keep-alive connection; others close after their answer
        await self.drain()
        self.config.timeout_graceful_shutdown = FLUSH_SECONDS
        await super().shutdown(sockets)

    async def drain(self) -> None:
        """Refuse what waits, let what runs go on until the deadline (or a second Ctrl-C), then stop it."""
        server = self.model_server
        queued = server.begin_shutdown()
        running = server.live_jobs() - queued
        log.info("shutting down: requests running %d, queued and refused %d; the running ones may go on for %g s "
                 "(--shutdown-timeout)", running, queued, self.deadline)
        loop = asyncio.get_running_loop()
        until = loop.time() + self.deadline
        while server.live_jobs() and loop.time() < until and not self.force_exit:
            await asyncio.sleep(0.05)
        stopped = server.stop_all()
        if stopped:
            log.info("shutdown deadline: requests stopped %d (streams end with finish_reason \"shutdown\", "
                     "others get 503)", stopped)
