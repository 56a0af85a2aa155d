"""Finding an elastic job's hosts, following how they change, and blacklisting failed ones.

Where the hosts come from (Horovod's ``horovod.runner.elastic.discovery``):

``HostDiscoveryScript``
    ``--host-discovery-script``: a command run as Horovod runs it, through the shell
    (``/bin/sh -c SCRIPT``), so it is a script's path or any command line. Each line it
    prints is ``HOST`` (which gets ``--slots-per-host`` slots) or ``HOST:SLOTS``
    (``[IPV6]:SLOTS`` for an IPv6 address, as ``-H`` takes it); blank lines are ignored,
    and an empty output means no host is available now. Unlike Horovod, a run is
    limited to ``DISCOVERY_TIMEOUT_S`` (60 s) and a failure reports the end of the
    script's stderr.
``FixedHosts``
    ``-H`` or ``--hostfile`` in an elastic job: the same hosts every time.

``HostManager`` keeps the hosts found last, in the order ranks are assigned to them:
hosts already known first, in their old order, then new hosts in the order discovery
lists them (Horovod appends new hosts in no set order). Each discovery is compared with
the last one as a ``HostUpdateResult``: ``added`` when a host appears or gains slots,
``removed`` when one disappears or loses slots, ``mixed`` for both.

A host whose worker failed is blacklisted: it takes no rank, for good, or with
``--blacklist-cooldown-range MIN MAX`` for ``clamp(MIN * 2**count + U(0, 1) * MIN, MIN,
MAX)`` seconds, ``count`` being how many times it has been blacklisted (this time
included). When its cooldown is over and discovery still lists it, it counts as
``added`` again and comes back after the hosts already in use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from hora.elastic import HostUpdateResult
from hora.runner.elastic.settings import ElasticSettings
from hora.runner.hosts import HostSpec, parse_host, parse_hostfile, parse_hosts

DISCOVERY_TIMEOUT_S = 60.0
"""How long one run of the discovery script may take (Horovod sets no limit)."""
STDERR_TAIL_CHARS = 2000
"""How much of the end of a failed script's stderr its error quotes."""

_LOG = logging.getLogger(__name__)


class HostDiscoveryError(RuntimeError):
    """The discovery script failed, timed out, or printed a line that is not a host.

    A ``RuntimeError``, as Horovod's: its driver fails the job when the first discovery
    raises one, and logs and retries when a later one does.
    """


class HostDiscovery(Protocol):
    """Where an elastic job's hosts come from."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Returns the available hosts and their slots, in the order they were listed.

        Raises:
            HostDiscoveryError: the hosts could not be found.
        """
        ...


def parse_discovery_output(text: str, default_slots: int | None, script: str) -> dict[str, int]:
    """Reads a discovery script's output: one ``HOST`` or ``HOST:SLOTS`` per line.

    Args:
        text: what the script printed.
        default_slots: the slots of a host listed without any (``--slots-per-host``);
            None when the flag was not given.
        script: the script, for error messages.

    Returns:
        The hosts and their slots, in the order listed. A host listed twice with the same
        slots counts once.

    Raises:
        HostDiscoveryError: a line is not a host (the message names the script, the
            line and what is accepted), a host is listed twice with different slots, or
            a host lacks a slot count while ``--slots-per-host`` is not given.
    """
    found: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"host discovery script {script!r}, line {number}"
        accepted = "a line is HOST or HOST:SLOTS; blank lines are ignored"
        if len(line.split()) > 1:
            raise HostDiscoveryError(f"{where}: {line!r} is not valid: {accepted}")
        try:
            spec = parse_host(line, where)
        except ValueError as exc:
            raise HostDiscoveryError(f"{exc} ({accepted})") from None
        given = ":" in (line.rpartition("]")[2] if line.startswith("[") else line)
        slots = spec.slots
        if not given:
            if default_slots is None:
                raise HostDiscoveryError(
                    f"{where}: {line!r} gives no slot count: print HOST:SLOTS, or pass --slots-per-host N"
                )
            slots = default_slots
        if found.get(spec.name, slots) != slots:
            raise HostDiscoveryError(
                f"{where}: host {spec.name!r} is listed again with {slots} slots after {found[spec.name]}: "
                "list each host once"
            )
        found[spec.name] = slots
    return found


def _tail(text: str) -> str:
    text = text.strip()
    if len(text) > STDERR_TAIL_CHARS:
        text = "..." + text[-STDERR_TAIL_CHARS:]
    return text


class HostDiscoveryScript:
    """Runs ``--host-discovery-script`` to find the hosts.

    Args:
        script: a script's path or a command line, run through ``/bin/sh -c``.
        default_slots: ``--slots-per-host``: the slots of a host listed without any;
            None when not given (then every line must give its slots).
        timeout: the longest one run may take, in seconds.
    """

    def __init__(self, script: str, default_slots: int | None = None, timeout: float = DISCOVERY_TIMEOUT_S) -> None:
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Runs the script and reads its output.

        Raises:
            HostDiscoveryError: the script could not be started, exited with a non-zero
                code, ran past the timeout (it is killed, with every process it started
                in its session), or printed a line that is not a host.
        """
        return parse_discovery_output(self._run(), self.default_slots, self.script)

    def _run(self) -> str:
        try:
            process = subprocess.Popen(
                self.script,
                shell=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,  # a timeout kills the script and its children together
            )
        except OSError as exc:
            raise HostDiscoveryError(
                f"host discovery script {self.script!r} could not be started: {exc.strerror or exc}"
            ) from None
        try:
            stdout, stderr = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                _, stderr = process.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a child left the session and holds the pipes
                stderr = ""
            tail = _tail(stderr)
            raise HostDiscoveryError(
                f"host discovery script {self.script!r} did not finish within {self.timeout:g} s and was killed"
                + (f"; the end of its stderr:\n{tail}" if tail else "")
            ) from None
        if process.returncode != 0:
            code = process.returncode
            hint = {126: " (is it executable?)", 127: " (command not found)"}.get(code, "")
            if code < 0:
                hint = f" (killed by signal {-code})"
            tail = _tail(stderr)
            raise HostDiscoveryError(
                f"Failed to execute discovery script: {self.script}. Exit code: {code}{hint}"
                + (f"; the end of its stderr:\n{tail}" if tail else "; it wrote nothing to stderr")
            )
        return stdout

    def __repr__(self) -> str:
        return f"HostDiscoveryScript({self.script!r}, default_slots={self.default_slots})"


class FixedHosts:
    """The hosts of ``-H`` or ``--hostfile`` in an elastic job: the same every time.

    Args:
        hosts: the hosts and their slots.
    """

    def __init__(self, hosts: Sequence[HostSpec]) -> None:
        self._hosts = {host.name: host.slots for host in hosts}

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Returns the fixed hosts (a copy)."""
        return dict(self._hosts)

    def set(self, hosts: Sequence[HostSpec]) -> None:
        """Replaces the hosts (Horovod's ``FixedHosts.set``, for tests and embedding)."""
        self._hosts = {host.name: host.slots for host in hosts}


def make_discovery(settings: ElasticSettings) -> HostDiscovery:
    """The discovery an elastic job's settings ask for (Horovod's ``_run_elastic``).

    Args:
        settings: validated elastic settings.

    Returns:
        A ``HostDiscoveryScript`` when a script is given, else ``FixedHosts`` of ``-H``
        or ``--hostfile``.

    Raises:
        ValueError: no source of hosts is given, the hosts are malformed, or fewer than
            two fixed hosts are given (Horovod's rule for fault tolerance).
    """
    if settings.host_discovery_script is not None:
        return HostDiscoveryScript(settings.host_discovery_script, settings.slots_per_host)
    if settings.hosts is not None:
        specs = parse_hosts(settings.hosts)
    elif settings.hostfile is not None:
        specs = parse_hostfile(settings.hostfile)
    else:
        raise ValueError("an elastic job needs --host-discovery-script SCRIPT, or -H/--hosts or --hostfile")
    if len(specs) < 2:
        raise ValueError(
            f"Cannot run in fault tolerance mode with fewer than 2 hosts: {', '.join(map(str, specs))} given; "
            "list at least 2 hosts or use --host-discovery-script"
        )
    return FixedHosts(specs)


@dataclasses.dataclass(frozen=True)
class DiscoveredHosts:
    """The hosts found by one discovery.

    Attributes:
        host_slots: every host discovery listed, with its slots (blacklisted ones too).
        order: the hosts that may take ranks (none blacklisted), in the order ranks are
            assigned to them.
    """

    host_slots: Mapping[str, int]
    order: tuple[str, ...]

    @property
    def available_hosts(self) -> frozenset[str]:
        """The hosts that may take ranks."""
        return frozenset(self.order)

    def get_slots(self, host: str) -> int:
        """A host's slots (0 when it was not listed)."""
        return self.host_slots.get(host, 0)

    def count_available_slots(self) -> int:
        """The slots of the hosts that may take ranks."""
        return sum(self.get_slots(host) for host in self.order)

    def host_specs(self) -> list[HostSpec]:
        """The hosts that may take ranks, in order, as ``assignment.host_assignments`` takes them."""
        return [HostSpec(host, self.host_slots[host]) for host in self.order]


@dataclasses.dataclass
class _HostState:
    blacklisted: bool = False
    count: int = 0  # how many times a cooldown was started
    cooldown_end: float | None = None  # clock time the current cooldown ends; None: none

    def in_cooldown(self, now: float) -> bool:
        return self.cooldown_end is not None and self.cooldown_end > now

    def is_resurrected(self, now: float) -> bool:
        return self.cooldown_end is not None and self.cooldown_end <= now


class HostManager:
    """The current hosts of an elastic job, their changes, and the blacklist.

    Not thread-safe: the driver calls it under its own lock, as Horovod's does.

    Args:
        discovery: where the hosts come from.
        cooldown_range: ``--blacklist-cooldown-range (MIN, MAX)`` in seconds, or None
            to blacklist failed hosts for good.
        clock: the time in seconds (``time.monotonic``; tests pass a fake one).
        uniform: draws from U(0, 1) (``random.random``; tests pass a fixed one).
    """

    def __init__(
        self,
        discovery: HostDiscovery,
        cooldown_range: tuple[int, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self._discovery = discovery
        self._cooldown_range = cooldown_range
        self._clock = clock
        self._uniform = uniform
        self._current = DiscoveredHosts({}, ())
        self._states: dict[str, _HostState] = {}

    def _state(self, host: str) -> _HostState:
        return self._states.setdefault(host, _HostState())

    def update_available_hosts(self) -> HostUpdateResult:
        """Runs discovery once and compares what it finds with the current hosts.

        Hosts whose cooldown is over come back (are whitelisted) and count as added.

        Returns:
            ``no_update`` when nothing changed; else ``added``, ``removed`` or ``mixed``.

        Raises:
            HostDiscoveryError: discovery failed (the current hosts are kept).
        """
        previous = self._current
        host_slots = self._discovery.find_available_hosts_and_slots()
        now = self._clock()
        resurrected = {host for host in host_slots if self._state(host).is_resurrected(now)}
        if host_slots == dict(previous.host_slots) and not resurrected:
            return HostUpdateResult.no_update
        available = [host for host in host_slots if host in resurrected or not self._state(host).blacklisted]
        order = [host for host in previous.order if host in available]
        order += [host for host in available if host not in order]
        self._current = DiscoveredHosts(dict(host_slots), tuple(order))
        result = _compare(host_slots, previous.host_slots, resurrected)
        for host in resurrected:
            _LOG.info("host %s is back from its blacklist cooldown", host)
            self._states[host].blacklisted = False
            self._states[host].cooldown_end = None
        return result

    @property
    def current_hosts(self) -> DiscoveredHosts:
        """The hosts of the last discovery; blacklisted hosts are left out of ``order``."""
        return self._current

    def blacklist(self, host: str) -> None:
        """Takes a host whose worker failed out of the job.

        Without a cooldown range the host stays out for good. With one, a cooldown
        starts unless one is running already (blacklisting a host again during its
        cooldown changes nothing); when it ends, the next discovery that lists the host
        brings it back.
        """
        state = self._state(host)
        now = self._clock()
        already = state.blacklisted
        state.blacklisted = True
        self._current = dataclasses.replace(self._current, order=tuple(h for h in self._current.order if h != host))
        if state.in_cooldown(now) or self._cooldown_range is None:
            if not already:
                _LOG.warning("blacklisting failing host %s for good", host)
            return
        low, high = self._cooldown_range
        state.count += 1
        delay = low * 2**state.count + self._uniform() * low
        seconds = max(low, min(high, delay))
        state.cooldown_end = now + seconds
        _LOG.warning("blacklisting failing host %s for %.1f s (blacklisted %d times)", host, seconds, state.count)

    def is_blacklisted(self, host: str) -> bool:
        """Whether a host is blacklisted (its cooldown may be over, until discovery brings it back)."""
        state = self._states.get(host)
        return state is not None and state.blacklisted

    def cooldown_end(self, host: str) -> float | None:
        """When a blacklisted host's cooldown ends, on the manager's clock; None without one."""
        state = self._states.get(host)
        return None if state is None else state.cooldown_end


def _compare(current: Mapping[str, int], previous: Mapping[str, int], resurrected: set[str]) -> HostUpdateResult:
    result = HostUpdateResult.no_update
    if any(host not in current for host in previous):
        result |= HostUpdateResult.removed
    for host, slots in current.items():
        if host not in previous or slots > previous[host]:
            result |= HostUpdateResult.added
        elif slots < previous[host]:
            result |= HostUpdateResult.removed
        elif host in resurrected:
            result |= HostUpdateResult.added
    return result
