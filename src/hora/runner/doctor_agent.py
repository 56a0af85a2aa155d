"""The agent ``horarun doctor`` runs on every host: ``python -m hora.runner.doctor_agent``.

It speaks JSON lines: requests on stdin, one reply per request on stdout.

``{"setup": {"secret": hex, "interfaces": [...], "toward": address}}``
    Picks the address this host's ranks would bind (``HORA_IFACE`` names, else the
    route toward ``toward``, the launcher's address as this host sees it), listens on
    it and replies ``{"address", "interface", "port", "loopback"}`` or ``{"error"}``.
``{"connect": [[host, address, port], ...], "timeout": s, "pings": n}``
    Connects to each peer's agent (HMAC handshake on the doctor's secret), measures
    the round trip of ``pings`` small messages, and replies
    ``{"results": [{"host", "ok", "error", "latency_ms"}, ...]}``.
``{"bandwidth": [host, address, port], "bytes": n, "timeout": s}``
    Sends ``n`` bytes to that peer and replies ``{"mb_per_s"}`` or ``{"error"}``.
``{"clock": true}``
    Replies ``{"time": time.time()}``, for the clock check.
``{"exit": true}`` (or end of input)
    Stops.

Incoming connections get the handshake, then serve ``P`` (echo 8 bytes) and ``B``
(read a length and that many bytes, answer one byte). The agent exits when its stdin
ends, so nothing stays behind on a host.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from hora.errors import AuthenticationError
from hora.transport import auth, netif, tcp

_PING = b"P"
_BULK = b"B"
_CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), _CHUNK))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class Agent:
    def __init__(self) -> None:
        self.secret = b""
        self.listener: socket.socket | None = None

    def setup(self, request: dict[str, Any]) -> dict[str, Any]:
        self.secret = bytes.fromhex(str(request["secret"]))
        names = [str(name) for name in request.get("interfaces") or []]
        toward = str(request.get("toward") or "")
        interface: str | None = None
        if names:
            chosen = netif.pick_interface(names)
            if chosen is None or chosen.address is None:
                present = ", ".join(f"{i.name} ({i.address or 'no IPv4'})" for i in netif.interfaces())
                return {"error": f"has none of the interfaces {','.join(names)}; it has {present}"}
            address, interface = chosen.address, chosen.name
        else:
            address = (netif.route_source(toward) if toward else None) or "127.0.0.1"
            interface = netif.interface_of(address)
        try:
            self.listener = tcp.listen(address)
        except OSError as exc:
            return {"error": f"cannot listen on {address}: {exc.strerror or exc}"}
        threading.Thread(target=self._accept, name="hora-doctor-accept", daemon=True).start()
        return {
            "address": address,
            "interface": interface,
            "port": self.listener.getsockname()[1],
            "loopback": netif.is_loopback_address(address),
        }

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                tcp.configure(sock)
                auth.accept_handshake(sock, self.secret)
                while True:
                    kind = sock.recv(1)
                    if kind == _PING:
                        sock.sendall(_recv_exact(sock, 8))
                    elif kind == _BULK:
                        (length,) = struct.unpack("<Q", _recv_exact(sock, 8))
                        remaining = length
                        buffer = bytearray(_CHUNK)
                        while remaining:
                            count = sock.recv_into(buffer, min(remaining, _CHUNK))
                            if not count:
                                return
                            remaining -= count
                        sock.sendall(b"k")
                    else:
                        return
            except (OSError, AuthenticationError, ConnectionError):
                return

    def _open(self, address: str, port: int, timeout: float) -> socket.socket:
        sock = socket.create_connection((address, port), timeout=timeout)
        tcp.configure(sock)
        auth.connect_handshake(sock, self.secret)
        sock.settimeout(timeout)
        return sock

    def connect(self, request: dict[str, Any]) -> dict[str, Any]:
        timeout = float(request.get("timeout", 3.0))
        pings = int(request.get("pings", 20))
        results = []
        for host, address, port in request["connect"]:
            result: dict[str, Any] = {"host": host, "ok": False}
            started = time.monotonic()
            try:
                with self._open(str(address), int(port), timeout) as sock:
                    times = []
                    for _ in range(pings):
                        begin = time.perf_counter()
                        sock.sendall(_PING + b"12345678")
                        _recv_exact(sock, 8)
                        times.append(time.perf_counter() - begin)
                    times.sort()
                    result.update(ok=True, latency_ms=1000 * times[len(times) // 2])
            except (TimeoutError, socket.timeout):
                result["error"] = f"timed out after {time.monotonic() - started:.1f} s"
            except ConnectionRefusedError:
                result["error"] = "connection refused"
            except AuthenticationError as exc:
                result["error"] = f"not hora's doctor on the other end ({exc})"
            except OSError as exc:
                result["error"] = exc.strerror or str(exc)
            results.append(result)
        return {"results": results}

    def bandwidth(self, request: dict[str, Any]) -> dict[str, Any]:
        _, address, port = request["bandwidth"]
        size = int(request.get("bytes", 16 << 20))
        timeout = float(request.get("timeout", 10.0))
        payload = bytes(min(size, _CHUNK))
        try:
            with self._open(str(address), int(port), timeout) as sock:
                begin = time.perf_counter()
                sock.sendall(_BULK + struct.pack("<Q", size))
                remaining = size
                while remaining:
                    part = payload[: min(remaining, len(payload))]
                    sock.sendall(part)
                    remaining -= len(part)
                _recv_exact(sock, 1)
                elapsed = time.perf_counter() - begin
        except (OSError, AuthenticationError, ConnectionError) as exc:
            return {"error": getattr(exc, "strerror", None) or str(exc) or type(exc).__name__}
        return {"mb_per_s": size / (1 << 20) / max(elapsed, 1e-9)}


def main(argv: Sequence[str] | None = None) -> int:
    """Serves requests on stdin until ``exit`` or end of input."""
    agent = Agent()
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if not isinstance(request, dict) or request.get("exit"):
            break
        try:
            if "setup" in request:
                reply = agent.setup(dict(request["setup"]))
            elif "connect" in request:
                reply = agent.connect(request)
            elif "clock" in request:
                reply = {"time": time.time()}
            elif "bandwidth" in request:
                reply = agent.bandwidth(request)
            else:
                reply = {"error": f"unknown request {sorted(request)}"}
        except (KeyError, TypeError, ValueError) as exc:
            reply = {"error": f"bad request: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
