"""The rendezvous protocol: a tiny authenticated key-value store that ranks meet through.

``horarun`` (or rank 0) runs the server (``hora.transport.rendezvous_server``); each rank connects with
``RendezvousClient``, publishes its address with ``put`` and learns its peers' with
``wait``, which blocks on the server until every key exists or the timeout passes, and
then names the keys (hence the ranks) that never arrived.

Frames (see ``tcp.FRAME_HEADER``), after the HMAC handshake:
``PUT key value`` -> ``OK``; ``WAIT timeout [keys]`` -> ``VALUES [values]`` or ``MISSING [keys]``;
either may be answered ``ERROR message`` (a value out of range, e.g. a timeout that is not a
finite number of seconds >= 0), and the connection stays usable.

Limits, checked by the client before it sends and by the server before it reads a payload
(``FRAME_LIMITS``): a key is at most ``MAX_KEY`` bytes, a value at most ``MAX_VALUE`` (what
hora stores is far smaller: a rank's host, address, port and machine id), a WAIT names at
most ``MAX_KEYS`` keys in at most ``MAX_WAIT_REQUEST`` bytes, and waits at most ``MAX_WAIT``
seconds (the client clamps a longer or infinite timeout; the server answers ERROR to one
that is NaN, negative or infinite, and clamps a longer finite one).
"""

from __future__ import annotations

from hora.errors import ProtocolError
from hora.transport import auth, netif, tcp
from hora.transport.codec import Reader, Writer

PUT = 1
WAIT = 2
OK = 10
VALUES = 11
MISSING = 12
ERROR = 13

MAX_KEY = 4096  # bytes; hora's keys are like "mesh/<generation>/<rank>"
MAX_VALUE = 1 << 20  # bytes; hora's values are records of a few hundred bytes
MAX_KEYS = 1 << 18  # keys in one WAIT: one per rank
MAX_WAIT_REQUEST = 4 << 20  # bytes of a WAIT's payload: room for ~200,000 ranks' keys
MAX_WAIT = 7 * 24 * 3600.0  # seconds one WAIT may last: "forever" for a job's start-up
_PUT_REQUEST = 4 + MAX_KEY + 4 + MAX_VALUE

# The largest payload the server reads for each request kind; any other kind is refused.
FRAME_LIMITS = {PUT: _PUT_REQUEST, WAIT: MAX_WAIT_REQUEST}
REQUEST_NAMES = {PUT: "PUT", WAIT: "WAIT"}


def encode_keys(keys: list[str]) -> Writer:
    writer = Writer().u32(len(keys))
    for key in keys:
        writer.string(key)
    return writer


def decode_keys(reader: Reader) -> list[str]:
    return [reader.string() for _ in range(reader.count(MAX_KEYS))]


def check_wait_timeout(timeout: float) -> float:
    """Returns the seconds a WAIT with ``timeout`` lasts: ``timeout``, at most ``MAX_WAIT``.

    Args:
        timeout: the requested seconds.

    Returns:
        ``min(timeout, MAX_WAIT)``.

    Raises:
        ValueError: ``timeout`` is NaN, negative or infinite; the message names it.
    """
    if not 0 <= timeout < float("inf"):
        raise ValueError(f"invalid wait timeout {timeout!r}: a WAIT takes a finite number of seconds >= 0")
    return min(timeout, MAX_WAIT)


class RendezvousTimeout(TimeoutError):
    """Some keys did not appear in time.

    Attributes:
        missing: the keys that never appeared.
    """

    def __init__(self, missing: list[str], timeout: float) -> None:
        super().__init__(f"{len(missing)} key(s) did not appear within {timeout:g} s: {', '.join(missing)}")
        self.missing = missing


class RendezvousClient:
    """An authenticated connection to the job's rendezvous server.

    Args:
        host: the server's address.
        port: the server's port.
        secret: the job secret.
        timeout: seconds to keep trying to connect.

    Raises:
        TimeoutError: the server could not be reached in time.
        AuthenticationError: the server does not hold the job secret.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        self.host = host
        self.port = port
        self._sock = tcp.connect(host, port, timeout)
        try:
            auth.connect_handshake(self._sock, secret)
        except BaseException:
            self._sock.close()
            raise

    def local_address(self) -> str:
        """The address this host used to reach the server: one its peers can reach too."""
        return str(self._sock.getsockname()[0])

    def put(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key`` (replacing an earlier value).

        Raises:
            ValueError: the key is longer than ``MAX_KEY`` bytes or the value longer than
                ``MAX_VALUE``.
            ProtocolError: the server refused the request.
        """
        encoded = key.encode("utf-8")
        if len(encoded) > MAX_KEY or len(value) > MAX_VALUE:
            raise ValueError(
                f"rendezvous put of key {key[:80]!r} ({len(encoded)} bytes) and a value of {len(value)} bytes: "
                f"keys are limited to {MAX_KEY} bytes and values to {MAX_VALUE}"
            )
        tcp.send_frame_blocking(self._sock, PUT, Writer().string(key).blob(value).bytes())
        kind, payload = tcp.recv_frame_blocking(self._sock)
        self._expect(kind, payload, OK)

    def wait(self, keys: list[str], timeout: float) -> list[bytes]:
        """Returns the values of ``keys``, waiting up to ``timeout`` for all of them.

        Args:
            keys: the keys to wait for.
            timeout: seconds; one above ``MAX_WAIT`` (or infinite) waits ``MAX_WAIT``.

        Raises:
            ValueError: ``timeout`` is NaN or negative, or ``keys`` exceed the request limits.
            RendezvousTimeout: some keys were still missing at the deadline.
            ProtocolError: the server refused the request.
        """
        if not timeout >= 0:
            raise ValueError(f"invalid rendezvous wait timeout {timeout!r}: a number of seconds >= 0")
        timeout = min(timeout, MAX_WAIT)
        request = Writer().f64(timeout)
        request.buffer += encode_keys(keys).buffer
        if len(keys) > MAX_KEYS or len(request.buffer) > MAX_WAIT_REQUEST:
            raise ValueError(
                f"rendezvous wait for {len(keys)} keys ({len(request.buffer)} bytes): a WAIT is limited to "
                f"{MAX_KEYS} keys and {MAX_WAIT_REQUEST} bytes"
            )
        self._sock.settimeout(timeout + 30.0)
        try:
            tcp.send_frame_blocking(self._sock, WAIT, request.bytes())
            kind, payload = tcp.recv_frame_blocking(self._sock)
        finally:
            self._sock.settimeout(None)
        reader = Reader(payload)
        if kind == MISSING:
            raise RendezvousTimeout(decode_keys(reader), timeout)
        self._expect(kind, payload, VALUES)
        values = [reader.blob() for _ in range(reader.count(MAX_KEYS))]
        reader.done()
        return values

    def _expect(self, kind: int, payload: bytes, wanted: int) -> None:
        if kind == ERROR:
            raise ProtocolError(f"rendezvous server refused the request: {Reader(payload).string()}")
        if kind != wanted:
            raise ProtocolError(f"rendezvous server sent message kind {kind}, expected {wanted}")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_loopback(host: str) -> bool:
    """True when ``host`` names this machine's loopback interface (``netif.is_loopback``)."""
    return netif.is_loopback(host)
