"""Ranks' output, from the Spark tasks that run them back to the driver.

A rank started by ``hora.spark.run`` is a child process of a Spark task on some
executor; what it prints would otherwise end up in that executor's log. Each task
forwards its rank's lines (already prefixed ``[<rank>]<stdout>:`` by
``hora.runner.output``) over one TCP connection to an ``OutputServer`` the driver runs
for the job, which writes them to ``run``'s ``stdout``/``stderr`` streams.

A connection first passes the job's HMAC challenge (``hora.transport.auth``), then
carries frames (``hora.transport.tcp``) of kind ``STDOUT`` or ``STDERR`` whose payload
is whole lines. A connection that fails the challenge or sends anything else is
dropped. Nothing here ever blocks a rank for the driver's sake beyond a socket send: a
task that cannot reach the driver writes the lines to its own streams instead (the
executor's log).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
from typing import TYPE_CHECKING, TextIO, cast

from hora.errors import AuthenticationError, ProtocolError
from hora.runner.output import Sink
from hora.transport import auth, tcp

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

log = logging.getLogger(__name__)

STDOUT = 1
STDERR = 2
MAX_FRAME = 1 << 20  # bytes of one frame: Sink writes whole lines, forwarded in pieces of at most 64 KiB
_JOIN_TIMEOUT = 2.0  # seconds stop() waits for each connection's thread to drain


class OutputServer:
    """Receives ranks' output on the driver and writes it to two sinks.

    Args:
        secret: the job secret each task must prove it holds.
        host: the address to listen on.
        stdout: where forwarded stdout lines go.
        stderr: where forwarded stderr lines go.
    """

    def __init__(self, secret: bytes, host: str, stdout: Sink, stderr: Sink) -> None:
        self._secret = secret
        self._sinks = {STDOUT: stdout, STDERR: stderr}
        self._listener = tcp.listen(host, 0)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="hora-spark-output", daemon=True)

    @property
    def port(self) -> int:
        """The port tasks connect to."""
        return int(self._listener.getsockname()[1])

    def start(self) -> OutputServer:
        """Starts accepting connections and returns self."""
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stops accepting; lets each connection drain what it already sent (bounded), then closes it."""
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout=_JOIN_TIMEOUT)
        with self._lock:
            threads = list(self._threads)
        # Tasks close their connection when their rank's output is drained; a task that
        # was killed may not have, so each connection gets a bounded time to finish.
        for thread in threads:
            thread.join(timeout=_JOIN_TIMEOUT)
        with self._lock:
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in threads:
            thread.join(timeout=_JOIN_TIMEOUT)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(
                target=self._serve, args=(sock, address), name="hora-spark-output-conn", daemon=True
            )
            with self._lock:
                self._connections.add(sock)
                self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket, address: tuple[str, int]) -> None:
        try:
            tcp.configure(sock)
            auth.accept_handshake(sock, self._secret)
            while True:
                kind, payload = tcp.recv_frame_blocking(sock, MAX_FRAME)
                sink = self._sinks.get(kind)
                if sink is None:
                    raise ProtocolError(f"unknown output frame kind {kind}")
                sink.write(payload)
        except (AuthenticationError, ProtocolError) as exc:
            log.warning("hora.spark: dropped an output connection from %s:%s: %s", address[0], address[1], exc)
        except OSError:
            pass  # the task closed its connection (or stop() shut it down)
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()


class _FrameWriter(io.RawIOBase):
    """The raw end of one forwarded stream: each write is one frame of one kind."""

    def __init__(self, client: OutputClient, kind: int) -> None:
        super().__init__()
        self._client = client
        self._kind = kind

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        payload = bytes(data)
        self._client.send(self._kind, payload)
        return len(payload)


class OutputClient:
    """A task's connection to the driver's ``OutputServer``.

    Args:
        host: the driver's address.
        port: the output server's port.
        secret: the job secret.
        timeout: seconds to keep trying to connect.

    Raises:
        TimeoutError: the driver could not be reached in time.
        AuthenticationError: the server does not hold the job secret.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        self._sock = tcp.connect(host, port, timeout)
        self._lock = threading.Lock()
        try:
            auth.connect_handshake(self._sock, secret)
        except BaseException:
            self._sock.close()
            raise

    def send(self, kind: int, payload: bytes) -> None:
        """Sends one frame; threads' frames never interleave.

        Raises:
            OSError: the connection is gone (``Sink`` then stops writing to it).
        """
        with self._lock:
            for start in range(0, len(payload), MAX_FRAME):
                tcp.send_frame_blocking(self._sock, kind, payload[start : start + MAX_FRAME])

    def stream(self, kind: int) -> TextIO:
        """Returns a text stream whose binary ``buffer`` forwards what ``Sink`` writes.

        Args:
            kind: ``STDOUT`` or ``STDERR``.
        """
        # Sink writes whole lines to the stream's buffer and flushes at once, so every
        # flush hands the raw writer whole lines: a frame never ends mid-line.
        buffered = io.BufferedWriter(_FrameWriter(self, kind))
        return cast(TextIO, io.TextIOWrapper(buffered, encoding="utf-8", errors="replace", write_through=True))

    def close(self) -> None:
        """Closes the connection (the server has then received everything sent)."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._sock.close()
