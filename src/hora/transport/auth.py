"""The per-job secret and the HMAC challenge every connection passes first.

The launcher makes a random secret per job and hands it to its ranks through
``HORA_SECRET``. Each connection (rank to rendezvous server, rank to rank) starts with
a mutual challenge, before either side parses anything else:

1. acceptor -> connector: ``MAGIC`` + 32-byte nonce ``a``
2. connector -> acceptor: ``MAGIC`` + 32-byte nonce ``c`` + HMAC-SHA256(secret, "connector" | a | c)
3. acceptor -> connector: HMAC-SHA256(secret, "acceptor" | c | a)

Each side checks the other's MAC with ``hmac.compare_digest``. A peer that sends the
wrong magic, a wrong MAC, or nothing within the timeout fails with
``AuthenticationError`` and is dropped; the secret never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from hora.errors import AuthenticationError, ProtocolError

MAGIC = b"HORA\x00\x01\x00\x00"  # protocol name and version
NONCE_BYTES = 32
MAC_BYTES = 32
SECRET_BYTES = 32
HANDSHAKE_TIMEOUT = 10.0
REPLY_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES  # the connector's answer, step 2


def new_secret() -> bytes:
    """Returns a fresh random job secret."""
    return os.urandom(SECRET_BYTES)


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise AuthenticationError("the peer closed the connection during the handshake (a wrong job secret?)")
        chunks += chunk
    return bytes(chunks)


def _check_magic(data: bytes) -> None:
    if data != MAGIC:
        raise AuthenticationError("the peer does not speak hora's protocol (bad magic bytes)")


class Challenge:
    """The acceptor's side of the challenge, without any I/O.

    For a caller that drives many connections at once on non-blocking sockets: send
    ``greeting()``, read exactly ``REPLY_BYTES``, and send what ``answer`` returns.
    ``accept_handshake`` runs the same steps on one blocking socket.

    Args:
        secret: the job secret.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nonce = os.urandom(NONCE_BYTES)  # fresh per connection: a recorded answer never replays

    def greeting(self) -> bytes:
        """Returns step 1: the magic and this side's nonce."""
        return MAGIC + self._nonce

    def answer(self, reply: bytes) -> bytes:
        """Checks the connector's reply (step 2) and returns this side's proof (step 3).

        Args:
            reply: exactly ``REPLY_BYTES`` bytes from the connector.

        Returns:
            The acceptor's MAC, to send back.

        Raises:
            AuthenticationError: the reply is not hora's, or the peer does not hold the secret.
        """
        if len(reply) != REPLY_BYTES:
            raise AuthenticationError(f"the peer's answer has {len(reply)} bytes, not {REPLY_BYTES}")
        _check_magic(reply[: len(MAGIC)])
        theirs = reply[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        mac = reply[len(MAGIC) + NONCE_BYTES :]
        if not hmac.compare_digest(mac, _mac(self._secret, b"connector", self._nonce, theirs)):
            raise AuthenticationError("the peer failed the challenge: it does not hold this job's secret")
        return _mac(self._secret, b"acceptor", theirs, self._nonce)


def accept_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Runs the acceptor's side of the challenge on a blocking socket.

    Args:
        sock: a freshly accepted connection.
        secret: the job secret.
        timeout: seconds the peer has to answer.

    Raises:
        AuthenticationError: the peer did not prove it knows the secret.
    """
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        challenge = Challenge(secret)
        sock.sendall(challenge.greeting())
        sock.sendall(challenge.answer(_recv_exact(sock, REPLY_BYTES)))
    except (TimeoutError, socket.timeout):
        raise AuthenticationError(f"the peer did not complete the handshake within {timeout:g} s") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, AuthenticationError):
            raise
        raise AuthenticationError(f"the connection failed during the handshake: {exc}") from None
    finally:
        sock.settimeout(previous)


def connect_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Runs the connector's side of the challenge on a blocking socket.

    Args:
        sock: a freshly connected socket.
        secret: the job secret.
        timeout: seconds the peer has to answer.

    Raises:
        AuthenticationError: the peer is not hora or does not hold the secret.
    """
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        _check_magic(hello[: len(MAGIC)])
        theirs = hello[len(MAGIC) :]
        mine = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + mine + _mac(secret, b"connector", theirs, mine))
        mac = _recv_exact(sock, MAC_BYTES)
        if not hmac.compare_digest(mac, _mac(secret, b"acceptor", mine, theirs)):
            raise AuthenticationError("the server failed the challenge: it does not hold this job's secret")
    except (TimeoutError, socket.timeout):
        raise AuthenticationError(f"the peer did not complete the handshake within {timeout:g} s") from None
    except (ConnectionError, OSError, ProtocolError) as exc:
        if isinstance(exc, AuthenticationError):
            raise
        raise AuthenticationError(f"the connection failed during the handshake: {exc}") from None
    finally:
        sock.settimeout(previous)
