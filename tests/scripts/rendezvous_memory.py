"""How much memory idle half-frame clients cost a rendezvous server (Linux: reads /proc).

Starts a ``RendezvousServer`` in a child process, opens ``--clients`` connections that pass
the HMAC handshake, announce a frame of ``--announce`` bytes, send ``--send`` bytes of it and
then go idle, and prints the server process's resident memory before and after, and how
many of the connections the server dropped::

    python tests/scripts/rendezvous_memory.py --clients 20 --announce 16777216
    python tests/scripts/rendezvous_memory.py --clients 20 --announce 1000000 --send 65536
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from hora.transport import auth, tcp
from hora.transport import rendezvous as proto

_SERVER = """
import sys, time
from hora.transport.rendezvous_server import RendezvousServer
server = RendezvousServer(bytes.fromhex(sys.argv[1])).start()
print(server.port, flush=True)
sys.stdin.read()
"""


def rss_kib(pid: int) -> int:
    """The resident set size of ``pid`` in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def dropped(sock: socket.socket) -> bool:
    """True when the server closed this connection."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--announce", type=int, default=16 * 1024 * 1024, help="payload size in the frame header")
    parser.add_argument("--send", type=int, default=100, help="payload bytes actually sent")
    parser.add_argument("--kind", choices=("put", "wait"), default="put", help="the request kind in the header")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to wait before measuring")
    args = parser.parse_args()
    kind = proto.PUT if args.kind == "put" else proto.WAIT
    secret = auth.new_secret()
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, secret.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdin is not None
    try:
        port = int(server.stdout.readline())
        warm = proto.RendezvousClient("127.0.0.1", port, secret, 10)
        warm.put("warm", b"up")
        warm.close()
        time.sleep(0.5)
        before = rss_kib(server.pid)
        clients = []
        for _ in range(args.clients):
            sock = tcp.connect("127.0.0.1", port, 10)
            auth.connect_handshake(sock, secret)
            sock.sendall(tcp.FRAME_HEADER.pack(args.announce, kind) + b"\x00" * args.send)
            clients.append(sock)
        time.sleep(args.settle)
        after = rss_kib(server.pid)
        report = {
            "clients": args.clients,
            "kind": args.kind,
            "announced_bytes": args.announce,
            "sent_bytes": args.send,
            "rss_before_mib": round(before / 1024, 1),
            "rss_after_mib": round(after / 1024, 1),
            "growth_mib": round((after - before) / 1024, 1),
            "dropped_by_server": sum(dropped(sock) for sock in clients),
        }
        print(json.dumps(report))
        for sock in clients:
            sock.close()
    finally:
        server.stdin.close()
        server.wait(10)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
