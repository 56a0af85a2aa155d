"""The elastic flags of ``horarun``, with horovodrun's spellings and defaults, and their checks.

* ``--min-np`` / ``--min-num-proc N``: the fewest ranks the job runs with (default: ``-np``);
* ``--max-np`` / ``--max-num-proc N``: the most ranks (default: no limit);
* ``--slots-per-host`` / ``--slots N``: the slots of a discovered host whose line gives none;
* ``--elastic-timeout SECONDS``: how long to wait for ``--min-np`` slots (default 600);
* ``--reset-limit N``: the most resets (resizes) before the job stops (default: no limit;
  0: none);
* ``--blacklist-cooldown-range MIN MAX``: a failed host comes back after a cooldown within
  [MIN, MAX] seconds, 1 <= MIN <= MAX <= 3600 (default: it stays blacklisted);
* ``--host-discovery-script SCRIPT``: the command that prints the available hosts.

As in horovodrun, a job is elastic when ``--host-discovery-script`` or ``--min-np`` is
given. An elastic job without a discovery script runs on the fixed hosts of ``-H`` or
``--hostfile``, which must name at least two hosts.

Checks hora adds to Horovod's (which ignores or fails later on these): ``-np`` must lie in
``[--min-np, --max-np]``, ``--min-np <= --max-np``, cooldown ``MIN <= MAX``, and the flags
that only an elastic job reads (``--max-np``, ``--slots-per-host``, ``--reset-limit``,
``--blacklist-cooldown-range``) are refused in a job that is not elastic rather than
silently ignored.
"""

from __future__ import annotations

import dataclasses

ELASTIC_TIMEOUT_S = 600
"""``--elastic-timeout``'s default (Horovod's ``ELASTIC_TIMEOUT_SECS``)."""
COOLDOWN_LOWER_LIMIT_S = 1
"""The least ``MIN`` of ``--blacklist-cooldown-range`` (Horovod's)."""
COOLDOWN_UPPER_LIMIT_S = 60 * 60
"""The greatest ``MAX`` of ``--blacklist-cooldown-range`` (Horovod's)."""
RESET_LIMIT_EXCEEDED_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
"""Horovod's message when ``--reset-limit`` is reached (``constants.py``), for the driver."""


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """The elastic flags as given (None: not given), with the host flags they depend on.

    Attributes:
        num_proc: ``-np``: the ranks to start with.
        min_num_proc: ``--min-np``; None means ``-np``.
        max_num_proc: ``--max-np``; None means no limit.
        slots_per_host: ``--slots-per-host``: slots of a discovered host listed without any.
        elastic_timeout: ``--elastic-timeout`` in seconds.
        reset_limit: ``--reset-limit``; None means no limit.
        blacklist_cooldown_range: ``--blacklist-cooldown-range MIN MAX`` in seconds;
            None means a failed host is blacklisted for good.
        host_discovery_script: ``--host-discovery-script``.
        hosts: ``-H/--hosts``.
        hostfile: ``--hostfile``.
    """

    num_proc: int | None = None
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    slots_per_host: int | None = None
    elastic_timeout: int = ELASTIC_TIMEOUT_S
    reset_limit: int | None = None
    blacklist_cooldown_range: tuple[int, int] | None = None
    host_discovery_script: str | None = None
    hosts: str | None = None
    hostfile: str | None = None

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic: a discovery script or ``--min-np`` is given (Horovod's rule)."""
        return self.host_discovery_script is not None or self.min_num_proc is not None

    @property
    def min_np(self) -> int | None:
        """The fewest ranks the job runs with: ``--min-np``, else ``-np``."""
        return self.min_num_proc if self.min_num_proc is not None else self.num_proc

    def validate(self) -> None:
        """Checks the flags, alone and together.

        Raises:
            ValueError: a flag's value is out of range, or the flags contradict each other;
                the message names the flag and its value.
        """
        for flag, value in (
            ("-np", self.num_proc),
            ("--min-np", self.min_num_proc),
            ("--max-np", self.max_num_proc),
            ("--slots-per-host", self.slots_per_host),
            ("--elastic-timeout", self.elastic_timeout),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} is not valid: expected an integer >= 1")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(
                f"--reset-limit {self.reset_limit} is not valid: expected an integer >= 0 "
                "(0: the job stops at the first change of hosts)"
            )
        if self.blacklist_cooldown_range is not None:
            _check_cooldown_range(self.blacklist_cooldown_range)
        given = [
            flag
            for flag, value in (
                ("-H/--hosts", self.hosts),
                ("--hostfile", self.hostfile),
                ("--host-discovery-script", self.host_discovery_script),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are exclusive: give one of them")
        if self.host_discovery_script is not None and not self.host_discovery_script.strip():
            raise ValueError("--host-discovery-script '' is not valid: expected a script's path or a command")
        if not self.elastic:
            cooldown = self.blacklist_cooldown_range
            for flag, shown in (
                ("--max-np", self.max_num_proc),
                ("--slots-per-host", self.slots_per_host),
                ("--reset-limit", self.reset_limit),
                ("--blacklist-cooldown-range", None if cooldown is None else f"{cooldown[0]} {cooldown[1]}"),
            ):
                if shown is not None:
                    raise ValueError(
                        f"{flag} {shown} applies only to an elastic job: add --min-np N or "
                        "--host-discovery-script SCRIPT, or drop it"
                    )
            return
        self._check_elastic()

    def _check_elastic(self) -> None:
        if self.num_proc is None:
            raise ValueError("an elastic job needs -np N: the number of ranks to start with")
        min_np = self.min_np
        assert min_np is not None  # num_proc is set
        if self.min_num_proc is not None and self.max_num_proc is not None and min_np > self.max_num_proc:
            raise ValueError(f"--min-np {min_np} exceeds --max-np {self.max_num_proc}: expected --min-np <= --max-np")
        if self.num_proc < min_np:
            raise ValueError(f"-np {self.num_proc} is below --min-np {min_np}: expected --min-np <= -np")
        if self.max_num_proc is not None and self.num_proc > self.max_num_proc:
            raise ValueError(f"-np {self.num_proc} exceeds --max-np {self.max_num_proc}: expected -np <= --max-np")
        if self.host_discovery_script is None and self.hosts is None and self.hostfile is None:
            raise ValueError(
                f"--min-np {self.min_num_proc} makes the job elastic, which needs --host-discovery-script SCRIPT, "
                "or -H/--hosts or --hostfile naming at least 2 hosts"
            )


def _check_cooldown_range(cooldown: tuple[int, int]) -> None:
    low, high = cooldown
    shown = f"--blacklist-cooldown-range {low} {high}"
    if low < COOLDOWN_LOWER_LIMIT_S:
        raise ValueError(f"{shown} is not valid: MIN must be >= {COOLDOWN_LOWER_LIMIT_S} second")
    if high > COOLDOWN_UPPER_LIMIT_S:
        raise ValueError(f"{shown} is not valid: MAX must be <= {COOLDOWN_UPPER_LIMIT_S} seconds")
    if low > high:
        raise ValueError(f"{shown} is not valid: expected MIN <= MAX")
