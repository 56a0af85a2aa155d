"""The rendezvous server, now in ``hora.transport.rendezvous_server``; kept importable here."""

from __future__ import annotations

from hora.transport.rendezvous_server import RendezvousServer

__all__ = ["RendezvousServer"]
