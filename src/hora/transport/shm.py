"""Shared memory between the ranks of one job on one machine.

Each rank of a *domain* (the job's ranks on one machine) owns one segment: a file in
``/dev/shm`` mapped into every local rank's memory. A segment holds

* a header: ``arrive[k]``, the number of barriers this rank has passed with domain
  rank ``k``, and ``sleeping``, set while this rank blocks;
* the fast lane's area (``hora.engine.fast_lane``): a few flags and two small slots
  through which cached small allreduces are negotiated and reduced; and
* a staging area in two halves, through which collectives move data (double
  buffering: a collective alternates halves, so it never waits for readers of the
  half it is about to fill).

Barriers are pairwise counters. Every collective two ranks share runs in the same
order on both (the coordinator's invariant), so ``arrive[me][k]`` and ``arrive[k][me]``
advance in step; a barrier with peers ``P`` bumps ``arrive[me][k]`` for each ``k`` in
``P`` and waits until each ``arrive[k][me]`` has caught up. Each counter has one
writer, so no atomic operations are needed. This relies on stores becoming visible
in program order (x86-64's memory model); on other machines the domain is not used
and ranks fall back to TCP.

Waiting spins briefly (a few microseconds: cross-process wake-ups through the kernel
cost tens of microseconds here) and then blocks: the waiter sets ``sleeping`` and
sleeps on an abstract Unix datagram socket; a rank that advances a counter sends one
byte to every sleeping peer. Wake-up bytes carry no data, so a stray datagram can only
cause a re-check. A blocked wait also reads the control links (an abort ends it) and
backs off its own timeout, so a lost wake-up costs milliseconds, never a hang.

Segments are unlinked as soon as every local rank has mapped them: the memory lives
until the last rank unmaps it, and a rank killed with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import platform
import select
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from hora.transport.tcp import CLOSED, LinkClosed, Patience, Watch

SHM_DIR = "/dev/shm"
PAGE_BYTES = 4096
HEADER_BYTES = 64 * 1024  # room for 8,000 local ranks' counters, page aligned
LANE_META = 8  # int64 flags at the start of the fast lane's area
LANE_SLOT_HEADER = 8  # int64 fields before each lane slot's data (64 bytes: data stays aligned)
LANE_DATA_BYTES = 256 * 1024  # a lane slot's data: the largest tensor the fast lane carries with its data
# The lane's flags and two slots (header and data each), rounded up to pages: staging stays page aligned.
LANE_BYTES = -(-(8 * LANE_META + 2 * (8 * LANE_SLOT_HEADER + LANE_DATA_BYTES)) // PAGE_BYTES) * PAGE_BYTES
# A barrier spins at least this long before it blocks (longer where the engine's policy
# says each rank has a CPU of its own: ``Domain.spin``).
SPIN_SECONDS = 50e-6
_SLEEP_MIN_MS = 1.0
_SLEEP_MAX_MS = 100.0
_SLEEPING = HEADER_BYTES // 8 - 1  # index of the sleeping flag in the int64 header


def supported() -> bool:
    """True where hora's shared-memory protocol is safe (a store-ordered CPU, /dev/shm)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def machine_id() -> str:
    """Identifies this machine's kernel instance: ranks that share it can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def job_key(secret: bytes) -> str:
    """A name prefix unique to one job (derived from its secret, which it does not reveal)."""
    return "hora-" + hashlib.sha256(b"hora-shm" + secret).hexdigest()[:16]


def segment_name(key: str, generation: int, rank: int) -> str:
    return f"{key}-{generation}-{rank}"


def _reserve(fd: int, size: int, name: str) -> None:
    """Allocates the segment's memory now, so that a full /dev/shm fails here, as an
    ``OSError`` (the domain then falls back to TCP on every rank), and not later as a
    SIGBUS on the first write to a page tmpfs has no room for. A container's /dev/shm is
    often 64 MB (Docker's default).

    Raises:
        OSError: /dev/shm has no room for ``size`` bytes.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a file system without fallocate: nothing to check with
        room = shutil.disk_usage(SHM_DIR).free
        raise OSError(
            exc.errno,
            f"{SHM_DIR} has no room for shared segment {name} ({size / 2**20:.1f} MiB; {room / 2**20:.1f} MiB "
            f"free): give it more (docker run --shm-size) or lower HORA_SHM_STAGING_MB",
        ) from exc


class Segment:
    """One rank's shared segment: a file under /dev/shm, mapped.

    Args:
        name: the file name under /dev/shm.
        size: its size in bytes.
        create: make the file (this rank's own segment) rather than open a peer's.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                _reserve(fd, size, name)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"shared segment {name} has {os.fstat(fd).st_size} bytes, expected {size}")
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:  # nobody else knows the file yet: it must not outlive this failure
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.counters = np.frombuffer(self.map, dtype=np.int64, count=HEADER_BYTES // 8)
        self.size = size

    def stage(self, half: int, half_bytes: int) -> np.ndarray:
        """Returns one half of the staging area as bytes."""
        offset = HEADER_BYTES + LANE_BYTES + half * half_bytes
        return np.frombuffer(self.map, dtype=np.uint8, count=half_bytes, offset=offset)

    def lane_meta(self) -> memoryview:
        """The fast lane's flags: ``LANE_META`` int64 (a memoryview: indexing gives a Python
        int, several times cheaper than a NumPy scalar)."""
        return self._int64s(HEADER_BYTES, LANE_META)

    def lane_slot(self, slot: int) -> tuple[memoryview, np.ndarray]:
        """One of the fast lane's two slots: its int64 header fields and its data bytes."""
        offset = HEADER_BYTES + 8 * LANE_META + slot * (8 * LANE_SLOT_HEADER + LANE_DATA_BYTES)
        data = np.frombuffer(self.map, dtype=np.uint8, count=LANE_DATA_BYTES, offset=offset + 8 * LANE_SLOT_HEADER)
        return self._int64s(offset, LANE_SLOT_HEADER), data

    def _int64s(self, offset: int, count: int) -> memoryview:
        with memoryview(self.map) as whole:
            return whole[offset : offset + 8 * count].cast("q")

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> bool:
        """Unmaps the segment, unless views into it are still alive.

        Returns:
            True when unmapped; False when arrays or memoryviews made from it still
            exist (the mapping, and the descriptor ``mmap`` keeps, then go when they do).
        """
        self.counters = np.empty(0, dtype=np.int64)  # drop the view before unmapping
        try:
            self.map.close()
        except BufferError:
            return False
        return True


class Domain:
    """The job's ranks on this machine, connected through shared memory.

    Args:
        key: the job's name prefix (``job_key``).
        generation: the job's initialization count, part of every name.
        ranks: the global ranks in the domain, sorted; ``me`` is one of them.
        me: this process's global rank.
        half_bytes: the size of each staging half (a multiple of the page size).
        round_bytes: how much of each half one round of a collective fills (the
            staging size in use, ``use_staging``); None: all of it.

    Raises:
        OSError: the segment or the wake-up socket could not be made.
    """

    def __init__(
        self, key: str, generation: int, ranks: Sequence[int], me: int, half_bytes: int, round_bytes: int | None = None
    ) -> None:
        self.ranks = tuple(ranks)
        self.me = me
        self.index = self.ranks.index(me)
        self.half_bytes = half_bytes
        self.round_bytes = half_bytes if round_bytes is None else self._round(round_bytes)
        self._key = key
        self._generation = generation
        self._size = HEADER_BYTES + LANE_BYTES + 2 * half_bytes
        self.segments: dict[int, Segment] = {}
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake.setblocking(False)
        try:
            self._wake.bind(self._address(me))
            self.segments[me] = Segment(segment_name(key, generation, me), self._size, create=True)
        except BaseException:
            self.close()
            raise
        self._arrived = self.segments[me].counters  # row ``me``: written only by this rank
        self._fence_lock = threading.Lock()
        self.watch: Watch | None = None
        # How long a barrier spins before it sleeps, asked at each wait (the engine sets its
        # policy: hora.engine.waiting.barrier_spin).
        self.spin: Callable[[], float] = lambda: SPIN_SECONDS

    def _address(self, rank: int) -> str:
        return "\0" + segment_name(self._key, self._generation, rank)

    def attach(self) -> None:
        """Maps every peer's segment (after every peer created its own)."""
        for rank in self.ranks:
            if rank not in self.segments:
                self.segments[rank] = Segment(segment_name(self._key, self._generation, rank), self._size, create=False)

    def unlink(self) -> None:
        """Removes this rank's segment name (after every peer mapped it)."""
        self.segments[self.me].unlink()

    def stage(self, rank: int, half: int) -> np.ndarray:
        """The staging half ``half`` of ``rank``'s segment, as bytes (all of it: a round
        fills its first ``round_bytes``)."""
        return self.segments[rank].stage(half, self.half_bytes)

    def use_staging(self, staging_bytes: int) -> None:
        """Makes each round fill ``staging_bytes / 2`` of each half (page aligned, at most
        the half): autotune's staging size.

        Every local rank must switch at the same point of the collective sequence (between
        two collectives, each of which ends with a barrier, so no round of the old size is
        still being read); autotune's ``PARAMS`` responses give that.
        """
        self.round_bytes = self._round(staging_bytes // 2)

    def _round(self, nbytes: int) -> int:
        return min(self.half_bytes, max(PAGE_BYTES, nbytes // PAGE_BYTES * PAGE_BYTES))

    def lane(self, rank: int) -> tuple[memoryview, tuple[tuple[memoryview, np.ndarray], ...]]:
        """``rank``'s fast-lane flags and its two slots (see ``Segment.lane_slot``)."""
        segment = self.segments[rank]
        return segment.lane_meta(), (segment.lane_slot(0), segment.lane_slot(1))

    def wake_fileno(self) -> int:
        """The socket wake-up bytes arrive on (readable: look again at the counters)."""
        return self._wake.fileno()

    def drain_wake(self) -> None:
        """Reads every pending wake-up byte."""
        with contextlib.suppress(OSError):
            while True:
                self._wake.recv(64)

    def barrier(self, peers: Sequence[int]) -> None:
        """Waits until every rank in ``peers`` (global ranks) has reached this barrier too.

        Raises:
            LinkClosed: a peer this barrier waits for died (its data link hung up).
            Exception: whatever the watch raises (an abort, a stall past the shutdown time).
        """
        me = self.index
        indices = [self.ranks.index(p) for p in peers if p != self.me]
        targets = []
        for k in indices:
            self._arrived[k] += 1
            targets.append(int(self._arrived[k]))
        # Store (my counters), fence, load (their sleeping flags): paired with the
        # waiter's store (sleeping), fence, load (counters) in _wait, so at least one side
        # sees the other's store and no wake-up is lost (x86-64 may otherwise let each
        # load pass the earlier store: the store-buffering pattern).
        self.fence()
        for k in indices:
            if self.segments[self.ranks[k]].counters[_SLEEPING]:
                self.send_wake(self.ranks[k])
        pending = [(self.ranks[k], self.segments[self.ranks[k]].counters, target) for k, target in zip(indices, targets)]
        if all(counters[me] >= target for _, counters, target in pending):
            return
        self._wait(
            lambda: all(counters[me] >= target for _, counters, target in pending),
            lambda: [rank for rank, counters, target in pending if counters[me] < target],
        )

    def fence(self) -> None:
        """A full memory fence: this rank's stores so far are visible before its next loads
        (a lock taken and released is a locked instruction on x86-64)."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def send_wake(self, rank: int) -> None:
        """Sends ``rank`` a wake-up byte (it then looks again at whatever it waits for)."""
        with contextlib.suppress(OSError):  # the peer's queue is full or it is gone: it re-checks anyway
            self._wake.sendto(b"\0", self._address(rank))

    def _wait(self, check: Callable[[], bool], laggards: Callable[[], list[int]]) -> None:
        """Spins briefly, then sleeps until ``check()`` holds.

        While asleep it reads the watched control links, watches the data links of the
        ``laggards()`` (the peers not yet arrived) for a hang-up, and reports a stall
        through the watch's patience once it waited that long.

        Raises:
            LinkClosed: a peer it waits for died.
            Exception: whatever the watch raises.
        """
        deadline = time.perf_counter() + self.spin()
        while time.perf_counter() < deadline:
            if check():
                return
        sleeping = self.segments[self.me].counters
        timeout = _SLEEP_MIN_MS
        watch = self.watch
        patience = Patience(watch)
        masks = {self._wake.fileno(): select.POLLIN}
        hang_ups = watch.register(masks, laggards()) if watch is not None else {}
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        try:
            while True:
                sleeping[_SLEEPING] = 1
                self.fence()  # see barrier: store sleeping, fence, load counters
                if check():
                    return
                stall_ms = patience.timeout_ms()
                events = poller.poll(timeout if stall_ms is None else min(timeout, stall_ms))
                # Back off only when no wake-up came: a missed wake-up costs at most this.
                timeout = _SLEEP_MIN_MS if events else min(timeout * 2, _SLEEP_MAX_MS)
                lost = None
                for fd, revents in events:
                    if fd == self._wake.fileno():
                        self.drain_wake()
                    elif watch is not None:
                        outcome = watch.service(fd, revents, hang_ups)
                        if outcome == "lost":
                            lost = hang_ups[fd]
                        elif outcome == "closed":
                            poller.unregister(fd)  # a control link at its end: readable for ever
                if lost is not None and not check():
                    raise LinkClosed(lost, CLOSED)
                patience.check(laggards)
        finally:
            sleeping[_SLEEPING] = 0

    def close(self) -> int:
        """Unmaps every segment and removes this rank's name if it is still there.

        Returns:
            How many segments stayed mapped because views into them are still alive
            (``Segment.close``).
        """
        own = self.segments.get(self.me)
        if own is not None:
            own.unlink()
        left = sum(not segment.close() for segment in self.segments.values())
        self.segments.clear()
        self._wake.close()
        return left


def stale_segments(key: str) -> list[str]:
    """Names under /dev/shm left by the job ``key`` (for a launcher's clean-up)."""
    try:
        return [name for name in os.listdir(SHM_DIR) if name.startswith(key + "-")]
    except OSError:
        return []
