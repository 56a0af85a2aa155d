"""Unit tests for the elastic driver's building blocks (hora.runner.elastic): discovery,
host changes, the blacklist and its cooldown, rank assignment, the elastic flags.

The tests that run a discovery script for real start a process: they are ``ranks`` tests.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from hora.elastic import HostUpdateResult
from hora.runner.elastic.assignment import NO_PREVIOUS_HOST_MESSAGE, host_assignments, pending_slots
from hora.runner.elastic.discovery import (
    FixedHosts,
    HostDiscoveryError,
    HostDiscoveryScript,
    HostManager,
    make_discovery,
    parse_discovery_output,
)
from hora.runner.elastic.settings import ELASTIC_TIMEOUT_S, ElasticSettings
from hora.runner.hosts import HostSpec, SlotInfo, assign_slots

pytestmark = pytest.mark.timeout(30)


# --- parsing the discovery output -------------------------------------------------------


def test_parse_hosts_with_and_without_slots() -> None:
    text = "a:4\n\n  b  \n[::1]:2\nc\n"
    assert parse_discovery_output(text, 3, "d.sh") == {"a": 4, "b": 3, "::1": 2, "c": 3}


def test_parse_keeps_the_listed_order_and_empty_output_is_no_host() -> None:
    assert list(parse_discovery_output("z:1\na:1\nm:1", None, "d.sh")) == ["z", "a", "m"]
    assert parse_discovery_output("", 1, "d.sh") == {}
    assert parse_discovery_output("\n \n", 1, "d.sh") == {}


def test_parse_a_host_listed_twice_alike_counts_once() -> None:
    assert parse_discovery_output("a:2\na:2", 1, "d.sh") == {"a": 2}
    with pytest.raises(HostDiscoveryError, match=r"line 2: host 'a' is listed again with 3 slots after 2"):
        parse_discovery_output("a:2\na:3", 1, "d.sh")


@pytest.mark.parametrize("line", ["a:x", "a:0", "a:-1", ":2", "a:1:2", "[::1", "a slots=2", "a b"])
def test_parse_errors_name_the_script_the_line_and_what_is_accepted(line: str) -> None:
    with pytest.raises(HostDiscoveryError) as info:
        parse_discovery_output(f"good:1\n{line}\n", 1, "/opt/discover.sh")
    message = str(info.value)
    assert "host discovery script '/opt/discover.sh', line 2" in message
    assert repr(line) in message
    assert "HOST or HOST:SLOTS" in message


def test_parse_a_host_without_slots_needs_slots_per_host() -> None:
    with pytest.raises(HostDiscoveryError, match=r"line 1: 'a' gives no slot count: .*--slots-per-host N"):
        parse_discovery_output("a\n", None, "d.sh")


# --- running the discovery script (starts processes) ------------------------------------


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.ranks
def test_script_by_path_is_run_and_parsed(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo host-a:2\necho\necho host-b\n")
    assert HostDiscoveryScript(script, 4).find_available_hosts_and_slots() == {"host-a": 2, "host-b": 4}


@pytest.mark.ranks
def test_script_may_be_a_shell_command(tmp_path: Path) -> None:
    (tmp_path / "hosts.txt").write_text("x:1\ny:3\n")
    command = f"cat {tmp_path / 'hosts.txt'} | sort -r"
    assert HostDiscoveryScript(command).find_available_hosts_and_slots() == {"y": 3, "x": 1}


@pytest.mark.ranks
def test_script_failure_names_the_exit_code_and_the_end_of_stderr(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo a:1\necho 'cloud API unreachable' >&2\nexit 3\n")
    with pytest.raises(HostDiscoveryError) as info:
        HostDiscoveryScript(script, 1).find_available_hosts_and_slots()
    message = str(info.value)
    assert f"Failed to execute discovery script: {script}. Exit code: 3" in message
    assert message.endswith("cloud API unreachable")


@pytest.mark.ranks
def test_script_not_executable_or_missing(tmp_path: Path) -> None:
    path = tmp_path / "plain.sh"
    path.write_text("echo a:1\n")
    with pytest.raises(HostDiscoveryError, match=r"Exit code: 126 \(is it executable\?\)"):
        HostDiscoveryScript(str(path), 1).find_available_hosts_and_slots()
    with pytest.raises(HostDiscoveryError, match=r"Exit code: 127 \(command not found\)"):
        HostDiscoveryScript(str(tmp_path / "missing.sh"), 1).find_available_hosts_and_slots()


@pytest.mark.ranks
def test_script_timeout_kills_it_and_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "survived"
    script = _script(tmp_path, f"echo slow >&2\n(sleep 2; touch {marker}) &\nsleep 30\n")
    with pytest.raises(HostDiscoveryError, match=r"did not finish within 0.5 s and was killed.*\nslow$"):
        HostDiscoveryScript(script, 1, timeout=0.5).find_available_hosts_and_slots()
    time.sleep(2.5)
    assert not marker.exists()


@pytest.mark.ranks
def test_script_bad_line_is_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, "echo a:1\necho 'b:two'\n")
    with pytest.raises(HostDiscoveryError, match=rf"host discovery script '{script}', line 2: 'b:two'"):
        HostDiscoveryScript(script, 1).find_available_hosts_and_slots()


# --- fixed hosts and make_discovery -----------------------------------------------------


def test_make_discovery_picks_the_script_or_fixed_hosts(tmp_path: Path) -> None:
    made = make_discovery(ElasticSettings(num_proc=2, host_discovery_script="d.sh", slots_per_host=4))
    assert isinstance(made, HostDiscoveryScript)
    assert (made.script, made.default_slots) == ("d.sh", 4)
    fixed = make_discovery(ElasticSettings(num_proc=2, min_num_proc=1, hosts="a:2,b"))
    assert fixed.find_available_hosts_and_slots() == {"a": 2, "b": 1}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=3\n")
    fixed = make_discovery(ElasticSettings(num_proc=2, min_num_proc=1, hostfile=str(hostfile)))
    assert fixed.find_available_hosts_and_slots() == {"a": 2, "b": 3}


def test_make_discovery_needs_two_fixed_hosts() -> None:
    with pytest.raises(ValueError, match=r"Cannot run in fault tolerance mode with fewer than 2 hosts: a:4 given"):
        make_discovery(ElasticSettings(num_proc=2, min_num_proc=1, hosts="a:4"))


# --- the host manager: changes ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager(
    *hosts: HostSpec, cooldown: tuple[int, int] | None = None, draw: float = 0.5
) -> tuple[HostManager, FixedHosts, Clock]:
    discovery = FixedHosts(hosts)
    clock = Clock()
    return HostManager(discovery, cooldown, clock=clock, uniform=lambda: draw), discovery, clock


def test_first_discovery_adds_then_nothing_changes() -> None:
    manager, _, _ = _manager(HostSpec("a", 2), HostSpec("b", 1))
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.order == ("a", "b")
    assert manager.current_hosts.count_available_slots() == 3
    assert manager.update_available_hosts() == HostUpdateResult.no_update


def test_diffs_added_removed_mixed() -> None:
    manager, discovery, _ = _manager(HostSpec("a", 2), HostSpec("b", 2))
    manager.update_available_hosts()
    discovery.set([HostSpec("a", 2), HostSpec("b", 2), HostSpec("c", 1)])
    assert manager.update_available_hosts() == HostUpdateResult.added
    discovery.set([HostSpec("a", 2), HostSpec("c", 1)])
    assert manager.update_available_hosts() == HostUpdateResult.removed
    discovery.set([HostSpec("a", 2), HostSpec("d", 1)])
    assert manager.update_available_hosts() == HostUpdateResult.mixed
    discovery.set([HostSpec("a", 3), HostSpec("d", 1)])  # more slots on a host
    assert manager.update_available_hosts() == HostUpdateResult.added
    discovery.set([HostSpec("a", 1), HostSpec("d", 1)])  # fewer slots
    assert manager.update_available_hosts() == HostUpdateResult.removed
    discovery.set([HostSpec("a", 2)])
    assert manager.update_available_hosts() == HostUpdateResult.mixed  # a gains, d leaves


def test_known_hosts_keep_their_place_new_ones_come_after() -> None:
    manager, discovery, _ = _manager(HostSpec("b", 1), HostSpec("a", 1))
    manager.update_available_hosts()
    discovery.set([HostSpec("z", 1), HostSpec("a", 1), HostSpec("c", 1), HostSpec("b", 1)])
    manager.update_available_hosts()
    assert manager.current_hosts.order == ("b", "a", "z", "c")
    assert manager.current_hosts.host_specs() == [HostSpec(name, 1) for name in "bazc"]


def test_failed_discovery_keeps_the_current_hosts() -> None:
    class Failing:
        def find_available_hosts_and_slots(self) -> dict[str, int]:
            raise HostDiscoveryError("boom")

    manager = HostManager(Failing())
    with pytest.raises(HostDiscoveryError, match="boom"):
        manager.update_available_hosts()
    assert manager.current_hosts.order == ()


# --- the host manager: the blacklist ----------------------------------------------------


def test_blacklist_is_permanent_without_cooldown() -> None:
    manager, _, clock = _manager(HostSpec("a", 2), HostSpec("b", 2))
    manager.update_available_hosts()
    manager.blacklist("a")
    assert manager.is_blacklisted("a") and not manager.is_blacklisted("b")
    assert manager.current_hosts.order == ("b",)
    assert manager.current_hosts.count_available_slots() == 2
    assert manager.cooldown_end("a") is None
    clock.now += 10**6
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.current_hosts.order == ("b",)
    assert manager.is_blacklisted("a")


def test_blacklisted_host_stays_out_when_discovery_changes() -> None:
    manager, discovery, _ = _manager(HostSpec("a", 2), HostSpec("b", 2))
    manager.update_available_hosts()
    manager.blacklist("a")
    discovery.set([HostSpec("a", 2), HostSpec("b", 2), HostSpec("c", 1)])
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert manager.current_hosts.order == ("b", "c")


def test_blacklist_with_cooldown_comes_back_as_added() -> None:
    manager, _, clock = _manager(HostSpec("a", 2), HostSpec("b", 2), cooldown=(10, 100), draw=0.5)
    manager.update_available_hosts()
    manager.blacklist("a")
    # clamp(10 * 2**1 + 0.5 * 10, 10, 100) = 25 s
    assert manager.cooldown_end("a") == 1025.0
    clock.now = 1024.9
    assert manager.update_available_hosts() == HostUpdateResult.no_update
    assert manager.current_hosts.order == ("b",)
    clock.now = 1025.0
    assert manager.update_available_hosts() == HostUpdateResult.added
    assert not manager.is_blacklisted("a")
    assert list(manager.current_hosts.order) == ["b", "a"]  # back after the hosts in use
    assert manager.update_available_hosts() == HostUpdateResult.no_update


def test_cooldown_doubles_and_is_clamped() -> None:
    manager, _, clock = _manager(HostSpec("a", 1), HostSpec("b", 1), cooldown=(10, 100), draw=0.0)
    manager.update_available_hosts()
    ends = []
    for _ in range(4):
        manager.blacklist("a")
        end = manager.cooldown_end("a")
        assert end is not None
        ends.append(end - clock.now)
        clock.now = end
        assert manager.update_available_hosts() == HostUpdateResult.added
    assert ends == [20.0, 40.0, 80.0, 100.0]  # 10 * 2**count, the last clamped to MAX


def test_cooldown_is_at_least_min() -> None:
    manager, _, _ = _manager(HostSpec("a", 1), cooldown=(5, 5), draw=0.99)
    manager.update_available_hosts()
    manager.blacklist("a")
    assert manager.cooldown_end("a") == 1005.0


def test_blacklisting_again_during_cooldown_changes_nothing() -> None:
    manager, _, clock = _manager(HostSpec("a", 1), HostSpec("b", 1), cooldown=(10, 1000), draw=0.0)
    manager.update_available_hosts()
    manager.blacklist("a")
    clock.now += 5
    manager.blacklist("a")
    assert manager.cooldown_end("a") == 1020.0


def test_resurrected_host_with_fewer_slots_counts_as_removed() -> None:
    # Horovod's order of checks: a slot change wins over the end of a cooldown.
    manager, discovery, clock = _manager(HostSpec("a", 2), HostSpec("b", 1), cooldown=(1, 10), draw=0.0)
    manager.update_available_hosts()
    manager.blacklist("a")
    clock.now += 10
    discovery.set([HostSpec("a", 1), HostSpec("b", 1)])
    assert manager.update_available_hosts() == HostUpdateResult.removed
    assert manager.current_hosts.order == ("b", "a")


# --- assignments ------------------------------------------------------------------------


def _topology(slots: list[SlotInfo]) -> list[tuple[str, int, int, int, int]]:
    return [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]


def test_assignments_fill_hosts_in_order_with_uneven_slots() -> None:
    hosts = [HostSpec("a", 3), HostSpec("b", 1), HostSpec("c", 2)]
    slots = host_assignments(hosts, min_np=1)
    assert [s.rank for s in slots] == list(range(6))
    assert {s.size for s in slots} == {6}
    assert slots == assign_slots(hosts, 6)  # a fixed job's topology (test_runner_hosts checks it)


def test_assignments_cap_at_max_np() -> None:
    slots = host_assignments([HostSpec("a", 2), HostSpec("b", 2), HostSpec("c", 2)], min_np=2, max_np=3)
    assert [(s.hostname, s.rank, s.size) for s in slots] == [("a", 0, 3), ("a", 1, 3), ("b", 2, 3)]
    assert _topology(slots)[2] == ("b", 0, 1, 1, 2)
    assert _topology(slots)[1] == ("a", 1, 2, 0, 1)


def test_assignments_below_min_np_name_it_and_the_slots() -> None:
    with pytest.raises(ValueError, match=r"\(4, --min-np\) than there are available slots \(3: a:2,b:1\)"):
        host_assignments([HostSpec("a", 2), HostSpec("b", 1)], min_np=4)
    with pytest.raises(ValueError, match=r"available slots \(0: no host\)"):
        host_assignments([], min_np=1)


def test_assignments_put_previous_hosts_first() -> None:
    previous = host_assignments([HostSpec("b", 1), HostSpec("c", 2)], min_np=1)
    available = [HostSpec("a", 2), HostSpec("c", 2), HostSpec("b", 1), HostSpec("d", 1)]
    slots = host_assignments(available, 1, None, previous)
    assert [s.hostname for s in slots] == ["b", "c", "c", "a", "a", "d"]
    assert slots[0].rank == 0 and slots[0].hostname == "b"


def test_assignments_previous_first_survives_the_cap() -> None:
    previous = host_assignments([HostSpec("old", 2), HostSpec("gone", 2)], min_np=1)
    slots = host_assignments([HostSpec("new", 4), HostSpec("old", 2)], 1, 2, previous)
    assert [s.hostname for s in slots] == ["old", "old"]


def test_assignments_need_a_previous_host() -> None:
    previous = host_assignments([HostSpec("a", 1), HostSpec("b", 1)], min_np=1)
    with pytest.raises(RuntimeError) as info:
        host_assignments([HostSpec("c", 2)], 1, None, previous)
    assert str(info.value) == NO_PREVIOUS_HOST_MESSAGE
    assert NO_PREVIOUS_HOST_MESSAGE == "No hosts from previous set remaining, unable to broadcast state."
    assert len(host_assignments([HostSpec("c", 2)], 1, None, [])) == 2  # empty previous: a first assignment


def test_assignment_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"--min-np 0 is not valid"):
        host_assignments([HostSpec("a", 1)], min_np=0)
    with pytest.raises(ValueError, match=r"--max-np 1 is below --min-np 2"):
        host_assignments([HostSpec("a", 2)], min_np=2, max_np=1)


def test_pending_slots_are_the_new_ones() -> None:
    previous = host_assignments([HostSpec("a", 2), HostSpec("b", 1)], min_np=1)
    slots = host_assignments([HostSpec("a", 3), HostSpec("c", 1)], 1, None, previous)
    running = {(s.hostname, s.local_rank) for s in previous}
    assert [(s.hostname, s.local_rank) for s in pending_slots(slots, running)] == [("a", 2), ("c", 0)]
    assert pending_slots(slots, set()) == slots
    running.discard(("a", 1))  # its worker died after the last world settled
    assert [(s.hostname, s.local_rank) for s in pending_slots(slots, running)] == [("a", 1), ("a", 2), ("c", 0)]


def test_manager_and_assignment_together() -> None:
    manager, discovery, _ = _manager(HostSpec("a", 2), HostSpec("b", 2))
    manager.update_available_hosts()
    first = host_assignments(manager.current_hosts.host_specs(), 2, 3)
    assert [s.hostname for s in first] == ["a", "a", "b"]
    manager.blacklist("a")
    discovery.set([HostSpec("c", 2), HostSpec("a", 2), HostSpec("b", 2)])
    assert manager.update_available_hosts() == HostUpdateResult.added
    second = host_assignments(manager.current_hosts.host_specs(), 2, 3, first)
    assert [(s.hostname, s.rank) for s in second] == [("b", 0), ("b", 1), ("c", 2)]


# --- settings ---------------------------------------------------------------------------


def test_settings_defaults_and_elastic_rule() -> None:
    settings = ElasticSettings(num_proc=4)
    assert settings.elastic_timeout == ELASTIC_TIMEOUT_S == 600
    assert not settings.elastic
    settings.validate()
    assert ElasticSettings(num_proc=4, min_num_proc=2, hosts="a:2,b:2").elastic
    script = ElasticSettings(num_proc=4, host_discovery_script="d.sh")
    assert script.elastic and script.min_np == 4
    script.validate()
    ElasticSettings(
        num_proc=4, min_num_proc=2, max_num_proc=8, slots_per_host=2, reset_limit=0,
        blacklist_cooldown_range=(1, 3600), host_discovery_script="d.sh",
    ).validate()  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ElasticSettings(num_proc=0), r"^-np 0 is not valid: expected an integer >= 1$"),
        (ElasticSettings(num_proc=2, min_num_proc=0, hosts="a,b"), r"^--min-np 0 is not valid"),
        (ElasticSettings(num_proc=2, host_discovery_script="d", max_num_proc=-1), r"^--max-np -1 is not valid"),
        (ElasticSettings(num_proc=2, host_discovery_script="d", slots_per_host=0), r"^--slots-per-host 0 is not"),
        (ElasticSettings(num_proc=2, host_discovery_script="d", elastic_timeout=0), r"^--elastic-timeout 0 is not"),
        (ElasticSettings(num_proc=2, host_discovery_script="d", reset_limit=-1), r"^--reset-limit -1 is not valid"),
        (
            ElasticSettings(num_proc=2, host_discovery_script="d", blacklist_cooldown_range=(0, 10)),
            r"^--blacklist-cooldown-range 0 10 is not valid: MIN must be >= 1 second$",
        ),
        (
            ElasticSettings(num_proc=2, host_discovery_script="d", blacklist_cooldown_range=(1, 3601)),
            r"^--blacklist-cooldown-range 1 3601 is not valid: MAX must be <= 3600 seconds$",
        ),
        (
            ElasticSettings(num_proc=2, host_discovery_script="d", blacklist_cooldown_range=(60, 30)),
            r"^--blacklist-cooldown-range 60 30 is not valid: expected MIN <= MAX$",
        ),
        (
            ElasticSettings(num_proc=2, host_discovery_script="d", hosts="a,b"),
            r"^-H/--hosts and --host-discovery-script are exclusive",
        ),
        (ElasticSettings(num_proc=2, host_discovery_script=" "), r"^--host-discovery-script '' is not valid"),
        (ElasticSettings(num_proc=2, max_num_proc=4), r"^--max-np 4 applies only to an elastic job: add --min-np"),
        (
            ElasticSettings(num_proc=2, blacklist_cooldown_range=(1, 2)),
            r"^--blacklist-cooldown-range 1 2 applies only to an elastic job",
        ),
        (ElasticSettings(host_discovery_script="d"), r"^an elastic job needs -np N"),
        (ElasticSettings(num_proc=4, min_num_proc=5, max_num_proc=3, hosts="a,b"), r"^--min-np 5 exceeds --max-np 3"),
        (ElasticSettings(num_proc=1, min_num_proc=2, hosts="a,b"), r"^-np 1 is below --min-np 2"),
        (ElasticSettings(num_proc=5, host_discovery_script="d", max_num_proc=4), r"^-np 5 exceeds --max-np 4"),
        (ElasticSettings(num_proc=2, min_num_proc=1), r"^--min-np 1 makes the job elastic, which needs"),
    ],
)
def test_settings_errors_name_the_flag_and_value(settings: ElasticSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.validate()
