"""Authenticated TCP links between ranks, framed control messages, and zero-copy data exchange.

A ``Link`` is one connected, authenticated socket to a peer rank. After set-up every
link is non-blocking; ``exchange`` moves any number of buffers to and from any number
of links at once, straight from and into NumPy memory (``send`` of a memoryview,
``recv_into``), waiting in ``poll`` when no socket can make progress (never spinning).
Because sends and receives progress together, two ranks that send each other large
buffers at the same moment cannot deadlock on full kernel buffers.

Control messages are frames: a 5-byte header (payload length, kind) and a payload.
``FrameReader`` assembles frames from whatever bytes a non-blocking read returns.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from hora.errors import ProtocolError

FRAME_HEADER = struct.Struct("<IB")  # payload length, kind
# The largest control frame: a request or response list of some 500,000 tensors. A
# reader holds only the bytes that arrived, never the size a header announces.
MAX_FRAME = 64 * 1024 * 1024
_RECV_CHUNK = 1 << 16
CLOSED = "its connection closed (the process exited, was killed, or shut down)"


class LinkClosed(ConnectionError):
    """The peer at the other end of a link closed it, reset it, or died.

    Attributes:
        link: the link that failed.
    """

    def __init__(self, link: Link, detail: str) -> None:
        super().__init__(f"lost the connection to rank {link.peer} ({link.peer_host}): {detail}")
        self.link = link
        self.detail = detail


class PeerProtocolError(ProtocolError):
    """A peer sent bytes on a link that are not a well-formed frame.

    Attributes:
        link: the link they came from (names the peer).
    """

    def __init__(self, link: Link, detail: str) -> None:
        super().__init__(f"rank {link.peer} ({link.peer_host}) sent a malformed frame: {detail}")
        self.link = link
        self.detail = detail


def configure(sock: socket.socket) -> None:
    """Sets the options every hora TCP connection uses (no Nagle delay, keepalive)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # A host that vanishes from the network is noticed in about 30 s instead of hours.
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option) and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def listen(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """Opens a listening TCP socket.

    Args:
        host: the address to bind.
        port: the port, 0 for any free one.
        backlog: pending connections the kernel queues.

    Returns:
        The listening socket.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connects to ``host:port``, retrying refused connections until ``timeout``.

    Raises:
        TimeoutError: no connection could be made in time; the message names the address.
    """
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            configure(sock)
            return sock
        except OSError as exc:
            if time.monotonic() + delay >= deadline:
                raise TimeoutError(f"could not connect to {host}:{port} within {timeout:g} s: {exc}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def encode_frame(kind: int, payload: bytes) -> bytes:
    """Returns the bytes of one frame: header, then payload."""
    return FRAME_HEADER.pack(len(payload), kind) + payload


def send_frame_blocking(sock: socket.socket, kind: int, payload: bytes) -> None:
    """Sends one frame on a blocking socket."""
    sock.sendall(encode_frame(kind, payload))


def recv_frame_blocking(sock: socket.socket, max_size: int = MAX_FRAME) -> tuple[int, bytes]:
    """Receives one frame on a blocking socket.

    Returns:
        (kind, payload).

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the header announces a frame larger than ``max_size``.
    """
    header = _recv_exact_blocking(sock, FRAME_HEADER.size)
    length, kind = FRAME_HEADER.unpack(header)
    if length > max_size:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_size}")
    return kind, _recv_exact_blocking(sock, length)


def _recv_exact_blocking(sock: socket.socket, count: int) -> bytes:
    """Receives exactly ``count`` bytes, holding only what has arrived (a peer that
    announces a large frame and goes quiet costs nothing)."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), _RECV_CHUNK))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class FrameReader:
    """Assembles frames from the bytes a non-blocking socket yields.

    Invariant: ``_buffer`` holds the bytes received but not yet returned as frames,
    always starting at a frame boundary.
    """

    def __init__(self, max_size: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self._max_size = max_size

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Adds received bytes and returns every frame now complete, in order.

        Raises:
            ProtocolError: a header announces a frame larger than the limit.
        """
        self._buffer += data
        frames: list[tuple[int, bytes]] = []
        offset = 0
        while len(self._buffer) - offset >= FRAME_HEADER.size:
            length, kind = FRAME_HEADER.unpack_from(self._buffer, offset)
            if length > self._max_size:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self._max_size}")
            end = offset + FRAME_HEADER.size + length
            if end > len(self._buffer):
                break
            frames.append((kind, bytes(self._buffer[offset + FRAME_HEADER.size : end])))
            offset = end
        del self._buffer[:offset]
        return frames


class Link:
    """An authenticated connection to one peer rank.

    Attributes:
        sock: the socket, non-blocking once ``set_nonblocking`` ran.
        peer: the peer's global rank.
        peer_host: the peer's host name, for error messages.
        frames: control frames received but not yet consumed, in arrival order.
        closed_by_peer: set when the peer closed its end.
        sending: a frame is part-way out (``send_frame`` waits for the socket): another
            frame must not be sent on this link until it is.
    """

    def __init__(self, sock: socket.socket, peer: int, peer_host: str) -> None:
        self.sock = sock
        self.peer = peer
        self.peer_host = peer_host
        self.frames: deque[tuple[int, bytes]] = deque()
        self.closed_by_peer = False
        self.close_detail = CLOSED
        self.sending = False
        self._reader = FrameReader()

    def fileno(self) -> int:
        return self.sock.fileno()

    def set_nonblocking(self) -> None:
        self.sock.setblocking(False)

    def pump(self) -> bool:
        """Reads whatever control bytes are available into ``frames``.

        Sets ``closed_by_peer`` (and ``close_detail``) instead of raising when the peer
        closed or reset the connection, so frames it sent before closing are still
        seen; the caller decides whether that closing was expected.

        Returns:
            True if at least one new frame arrived or the peer closed.

        Raises:
            PeerProtocolError: the peer sent a malformed frame header.
        """
        changed = False
        while not self.closed_by_peer:
            try:
                data = self.sock.recv(_RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                data = b""
                self.close_detail = _describe(exc)
            if not data:
                self.closed_by_peer = True
                return True
            try:
                new = self._reader.feed(data)
            except ProtocolError as exc:
                raise PeerProtocolError(self, str(exc)) from None
            if new:
                self.frames.extend(new)
                changed = True
        return changed

    def send_frame(self, kind: int, payload: bytes, watch: Watch | None = None) -> None:
        """Sends one control frame on the non-blocking socket, waiting as needed."""
        frame = encode_frame(kind, payload)
        try:
            sent = self.sock.send(frame)  # a small frame almost always fits at once
        except OSError:
            sent = 0  # full, or failed: ``exchange`` waits, or reports the failure
        if sent < len(frame):
            self.sending = True
            try:
                exchange([(self, memoryview(frame)[sent:])], [], watch)
            finally:
                self.sending = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Interrupts(Protocol):
    """Signals held back while a data-plane wait runs (``hora.engine.interrupts``)."""

    def fileno(self) -> int:
        """Readable once a signal is pending."""

    def clear_wake(self) -> None:
        """Reads the wake-up bytes (the signal stays pending)."""

    def deadline(self, idle_since: float) -> float | None:
        """When a wait without progress since ``idle_since`` gives up (None: no signal)."""

    def give_up(self) -> None:
        """Runs the held-back handlers now; raises what they raise."""


class Watch:
    """What every data-plane wait keeps an eye on besides its own transfer.

    * Control links: an exchange that blocks also reads these, so a message (an abort,
      a request) is seen even mid-collective and a peer's control socket never fills
      up. ``on_frame`` is called after new frames arrive or the peer closes, and may
      raise to abandon the wait.
    * Peers' data links (``data``, by global rank): a wait that depends on a peer also
      watches that peer's link for a hang-up (``POLLRDHUP``, nothing is read), so a
      peer that dies is noticed by whoever waits for it, even when the wait itself
      moves no bytes on that link (a shared-memory barrier).
    * Patience: a wait that has made no progress for ``stall_after`` seconds calls
      ``on_stall(peers, seconds)`` with the peers it waits for; that reports the stall
      and returns how long the wait may go on before the next call (None: never), or
      raises to end it.
    * Interrupts: a signal held back while the main thread runs a collective
      (``interrupts``) wakes the wait, which gives up once it has made no progress for
      a while after it (see ``hora.engine.interrupts``).

    Invariant: one thread at a time runs data-plane waits (the one in an engine pass),
    so nothing here needs a lock.
    """

    def __init__(
        self,
        links: Sequence[Link],
        on_frame: Callable[[Link], None],
        data: Mapping[int, Link] | None = None,
        stall_after: float | None = None,
        on_stall: Callable[[Sequence[int], float], float | None] | None = None,
        interrupts: Interrupts | None = None,
    ) -> None:
        self.links = {link.fileno(): link for link in links}
        self.on_frame = on_frame
        self.data = dict(data or {})
        self.stall_after = stall_after if on_stall is not None else None
        self.on_stall = on_stall
        self.interrupts = interrupts

    def register(self, masks: dict[int, int], peers: Iterable[int] = ()) -> dict[int, Link]:
        """Adds the control links, and the data links of ``peers`` (for a hang-up), to a
        poll mask table; returns the data links it added, by file descriptor."""
        for fd in self.links:
            masks[fd] = masks.get(fd, 0) | _POLL_IN
        if self.interrupts is not None:
            masks[self.interrupts.fileno()] = _POLL_IN
        hang_ups = {}
        for peer in peers:
            link = self.data.get(peer)
            if link is not None and not link.closed_by_peer:
                fd = link.fileno()
                masks[fd] = masks.get(fd, 0) | _POLL_HANG_UP
                hang_ups[fd] = link
        return hang_ups

    def service(self, fd: int, events: int, hang_ups: Mapping[int, Link]) -> str | None:
        """Handles one poll event of a registered descriptor.

        Returns:
            ``"lost"`` when a watched peer's data link hung up (the caller looks once
            more at what it waits for, then raises ``LinkClosed`` for it);
            ``"closed"`` when a control link reached its end (a caller that keeps its
            poll set unregisters it: it would be readable for ever); else None.

        Raises:
            Exception: whatever ``on_frame`` raises.
        """
        if self.interrupts is not None and fd == self.interrupts.fileno():
            self.interrupts.clear_wake()  # the wait's Patience now has a deadline to give up at
            return None
        if fd in self.links and events & (_POLL_IN | _POLL_ERR):
            link = self.links[fd]
            if not link.pump():
                return None
            closed = link.closed_by_peer
            if closed:
                del self.links[fd]
            self.on_frame(link)
            return "closed" if closed else None
        if fd in hang_ups and events & (_POLL_HANG_UP | _POLL_ERR):
            return "lost"
        return None


_POLL_IN = select.POLLIN | select.POLLPRI
_POLL_OUT = select.POLLOUT
_POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLL_HANG_UP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP


class Patience:
    """One wait's clocks: when it next calls ``Watch.on_stall``, and when a held-back
    signal makes it give up (``Watch.interrupts``).

    Args:
        watch: the watch whose ``stall_after``, ``on_stall`` and ``interrupts`` apply.
    """

    __slots__ = ("_due", "_interrupts", "_on_stall", "since")

    def __init__(self, watch: Watch | None) -> None:
        self.since = time.monotonic()
        self._on_stall = watch.on_stall if watch is not None else None
        self._due = watch.stall_after if watch is not None else None
        self._interrupts = watch.interrupts if watch is not None else None

    def progress(self) -> None:
        """The wait moved: the clocks start again."""
        self.since = time.monotonic()

    def timeout_ms(self) -> float | None:
        """How long the next poll may block before a clock is due (None: no limit)."""
        due = None if self._due is None else self.since + self._due
        if self._interrupts is not None:
            give_up = self._interrupts.deadline(self.since)
            if give_up is not None:
                due = give_up if due is None else min(due, give_up)
        return None if due is None else max(0.0, (due - time.monotonic()) * 1000.0)

    def check(self, peers: Callable[[], Sequence[int]]) -> None:
        """Gives up on a held-back signal, or reports a stall, if one is due
        (``peers()``: whom the wait waits for).

        Raises:
            Exception: whatever ``on_stall`` or the held-back signal handlers raise.
        """
        now = time.monotonic()
        if self._interrupts is not None:
            give_up = self._interrupts.deadline(self.since)
            if give_up is not None and now >= give_up:
                self._interrupts.give_up()
        if self._due is None or self._on_stall is None:
            return
        waited = now - self.since
        if waited >= self._due:
            self._due = self._on_stall(peers(), waited)


class _Transfer:
    """One buffer being sent or received; ``done`` counts the bytes moved so far."""

    __slots__ = ("done", "link", "view")

    def __init__(self, link: Link, view: memoryview) -> None:
        self.link = link
        self.view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        self.done = 0

    @property
    def pending(self) -> bool:
        return self.done < len(self.view)


def exchange(
    sends: Sequence[tuple[Link, memoryview]],
    recvs: Sequence[tuple[Link, memoryview]],
    watch: Watch | None = None,
) -> None:
    """Sends and receives the given buffers concurrently, returning when all are done.

    Each buffer is transferred in full; a link may appear in both lists (both
    directions of one socket run at once). Bytes go straight from and into the
    buffers' memory.

    Args:
        sends: (link, bytes to send) pairs.
        recvs: (link, buffer to fill) pairs; each buffer is filled completely.
        watch: control links to keep reading while waiting, and the stall clock.

    Raises:
        LinkClosed: a peer closed, reset, or died; names the peer.
        Exception: whatever ``watch.on_frame`` or ``watch.on_stall`` raises.
    """
    outgoing = [_Transfer(link, view) for link, view in sends]
    incoming = [_Transfer(link, view) for link, view in recvs]
    patience = Patience(watch)
    while True:
        moved = False
        # Progress every transfer as far as the kernel allows without blocking.
        for transfer in outgoing:
            while transfer.pending:
                try:
                    transfer.done += transfer.link.sock.send(transfer.view[transfer.done :])
                    moved = True
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise LinkClosed(transfer.link, _describe(exc)) from None
        for transfer in incoming:
            while transfer.pending:
                try:
                    n = transfer.link.sock.recv_into(transfer.view[transfer.done :])
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    raise LinkClosed(transfer.link, _describe(exc)) from None
                if n == 0:
                    transfer.link.closed_by_peer = True
                    raise LinkClosed(transfer.link, CLOSED)
                transfer.done += n
                moved = True
        outgoing = [t for t in outgoing if t.pending]
        incoming = [t for t in incoming if t.pending]
        if not outgoing and not incoming:
            return
        if moved:
            patience.progress()
        wait([t.link for t in outgoing], [t.link for t in incoming], watch, patience)


def wait(sending: Sequence[Link], receiving: Sequence[Link], watch: Watch | None, patience: Patience | None = None) -> None:
    """Blocks until a link in ``sending`` can send or one in ``receiving`` has data.

    Meanwhile the watched control links are read (``watch.on_frame`` may raise), and
    with ``patience`` a wait that outlasts its stall clock reports the peers it waits
    for (``watch.on_stall`` may raise) and returns so the caller looks again.
    """
    masks: dict[int, int] = {}
    for link in sending:
        fd = link.fileno()
        masks[fd] = masks.get(fd, 0) | _POLL_OUT
    for link in receiving:
        fd = link.fileno()
        masks[fd] = masks.get(fd, 0) | _POLL_IN
    if watch is not None:
        watch.register(masks)
    poller = select.poll()
    for fd, mask in masks.items():
        poller.register(fd, mask)
    events = poller.poll(patience.timeout_ms() if patience is not None else None)
    for fd, revents in events:
        # A data socket's error or hang-up shows when it is next read or written;
        # only watched links are serviced here.
        if watch is not None:
            watch.service(fd, revents, {})
    if patience is not None:
        patience.check(lambda: sorted({link.peer for link in (*receiving, *sending)}))


class RingLinks:
    """A rank's place in a ring: non-blocking sends to the right, receives from the left.

    Implements ``collectives.pipeline.RingStream``. ``right`` and ``left`` may be one link
    (a ring of two ranks).
    """

    def __init__(self, right: Link, left: Link, watch: Watch | None) -> None:
        self._right = right
        self._left = left
        self._watch = watch
        self._patience = Patience(watch)

    def send(self, data: memoryview) -> int:
        try:
            sent = self._right.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise LinkClosed(self._right, _describe(exc)) from None
        if sent:
            self._patience.progress()
        return sent

    def recv_into(self, data: memoryview) -> int:
        if not len(data):
            return 0
        try:
            received = self._left.sock.recv_into(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise LinkClosed(self._left, _describe(exc)) from None
        if received == 0:
            self._left.closed_by_peer = True
            raise LinkClosed(self._left, CLOSED)
        self._patience.progress()
        return received

    def wait(self, sending: bool, receiving: bool) -> None:
        wait([self._right] if sending else [], [self._left] if receiving else [], self._watch, self._patience)


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ECONNRESET, errno.EPIPE):
        return "the connection was reset (the peer process probably died)"
    return str(exc)
