"""The rendezvous protocol: a tiny authenticated key-value store that ranks meet through.

``horarun`` (or rank 0) runs the server (``hora.transport.rendezvous_server``); each rank connects with
``RendezvousClient``, publishes its address with ``put`` and learns its peers' with
``wait``, which blocks on the server until every key exists or the timeout passes, and
then names the keys (hence the ranks) that never arrived.

Frames (see ``tcp.FRAME_HEADER``), after the HMAC handshake:
``PUT key value`` -> ``OK``; ``WAIT timeout [keys]`` -> ``VALUES [values]`` or ``MISSING [keys]``.
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

MAX_KEYS = 1 << 20


def encode_keys(keys: list[str]) -> Writer:
    writer = Writer().u32(len(keys))
    for key in keys:
        writer.string(key)
    return writer


def decode_keys(reader: Reader) -> list[str]:
    return [reader.string() for _ in range(reader.count(MAX_KEYS))]


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
        """Stores ``value`` under ``key`` (replacing an earlier value)."""
        tcp.send_frame_blocking(self._sock, PUT, Writer().string(key).blob(value).bytes())
        kind, payload = tcp.recv_frame_blocking(self._sock)
        self._expect(kind, payload, OK)

    def wait(self, keys: list[str], timeout: float) -> list[bytes]:
        """Returns the values of ``keys``, waiting up to ``timeout`` for all of them.

        Raises:
            RendezvousTimeout: some keys were still missing at the deadline.
        """
        request = Writer().f64(timeout)
        request.buffer += encode_keys(keys).buffer
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
