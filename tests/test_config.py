import pytest

from hora.config import DEFAULT_FUSION_THRESHOLD, Config


def test_defaults_without_launcher():
    config = Config.from_env({})
    assert config.topology.size == 1 and config.topology.rank == 0
    assert config.fusion_threshold == DEFAULT_FUSION_THRESHOLD == 128 * 1024 * 1024
    assert config.stall_check_time_seconds == 60 and config.stall_shutdown_time_seconds == 0
    assert config.cache_capacity == 1024 and config.log_level == "WARNING"
    assert config.secret is None


def test_horovod_aliases_and_precedence():
    config = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "2.5"})
    assert config.fusion_threshold == 1024 and config.cycle_time_ms == 2.5
    config = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "HORA_FUSION_THRESHOLD": "0"})
    assert config.fusion_threshold == 0
    config = Config.from_env({"HOROVOD_LOG_LEVEL": "debug", "HOROVOD_STALL_CHECK_DISABLE": "1"})
    assert config.log_level == "DEBUG" and config.stall_check_disable


def test_topology_and_launch_variables():
    env = {
        "HOROVOD_RANK": "2",
        "HOROVOD_SIZE": "4",
        "HORA_LOCAL_RANK": "0",
        "HORA_LOCAL_SIZE": "2",
        "HORA_CROSS_RANK": "1",
        "HORA_CROSS_SIZE": "2",
        "HORA_HOSTNAME": "node1",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
        "HORA_SECRET": "ab" * 32,
    }
    config = Config.from_env(env)
    t = config.topology
    assert (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (2, 4, 0, 2, 1, 2)
    assert t.hostname == "node1"
    assert (config.rendezvous_addr, config.rendezvous_port, config.secret) == ("10.0.0.1", 1234, b"\xab" * 32)
    assert "abab" not in repr(config)  # the secret is never shown


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"HORA_FUSION_THRESHOLD": "-1"}, "HORA_FUSION_THRESHOLD='-1' is not valid: expected an integer >= 0"),
        ({"HOROVOD_FUSION_THRESHOLD": "big"}, "HOROVOD_FUSION_THRESHOLD='big'"),
        ({"HORA_STALL_CHECK_TIME_SECONDS": "0"}, "expected a number > 0"),
        ({"HORA_LOG_LEVEL": "LOUD"}, "expected one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"),
        ({"HORA_ELASTIC": "maybe"}, "HORA_ELASTIC='maybe' is not valid: expected one of 1, 0, true"),
        ({"HORA_RANK": "3", "HORA_SIZE": "2"}, "HORA_RANK=3 is not valid: expected an integer in [0, HORA_SIZE=2)"),
        ({"HORA_SIZE": "0"}, "HORA_SIZE='0'"),
        ({"HORA_SECRET": "zz"}, "HORA_SECRET is not valid: expected a hex string"),
        ({"HORA_SECRET": "abcd"}, "at least 16 bytes"),
        ({"HORA_SIZE": "2", "HORA_RANK": "1"}, "HORA_RENDEZVOUS_ADDR, HORA_RENDEZVOUS_PORT, HORA_SECRET are not set"),
    ],
)
def test_bad_values_name_the_variable_and_what_is_accepted(env, fragment):
    with pytest.raises(ValueError) as info:
        Config.from_env(env)
    assert fragment in str(info.value)
    if "HORA_SECRET" in env:
        assert env["HORA_SECRET"] not in str(info.value) or len(env["HORA_SECRET"]) < 3


def test_horovods_cpu_operations_name_hora_transports() -> None:
    assert Config.from_env({"HOROVOD_CPU_OPERATIONS": "gloo"}).transport == "builtin"
    assert Config.from_env({"HOROVOD_CPU_OPERATIONS": "MPI"}).transport == "mpi"
    assert Config.from_env({"HOROVOD_CPU_OPERATIONS": "mpi", "HORA_TRANSPORT": "builtin"}).transport == "builtin"
    with pytest.raises(ValueError, match=r"HOROVOD_CPU_OPERATIONS='ccl' is not valid: expected one of builtin, mpi"):
        Config.from_env({"HOROVOD_CPU_OPERATIONS": "ccl"})
    # horovodrun's Gloo launcher sets HOROVOD_CONTROLLER=gloo beside it; alone it still counts.
    assert Config.from_env({"HOROVOD_CONTROLLER": "mpi"}).transport == "mpi"
    assert Config.from_env({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "gloo"}).transport == "builtin"
    with pytest.raises(ValueError, match=r"HOROVOD_CONTROLLER='jsrun' is not valid"):
        Config.from_env({"HOROVOD_CONTROLLER": "jsrun"})


def test_gradient_overlap_follows_the_layout_and_the_cpus() -> None:
    import dataclasses

    from hora.config import Topology
    from hora.core.api import gradient_overlap

    def config(size: int, local: int, setting: bool | None = None) -> Config:
        topology = Topology(size=size, local_size=local, cross_size=size // local)
        return dataclasses.replace(Config(), topology=topology, gradient_overlap=setting)

    assert not gradient_overlap(config(2, 2), cpus=2)  # one machine, a rank per CPU
    assert not gradient_overlap(config(4, 4), cpus=2)  # more ranks than CPUs
    assert gradient_overlap(config(2, 2), cpus=8)  # CPUs to spare
    assert gradient_overlap(config(4, 2), cpus=2)  # across machines: the network's waits hide behind backward
    assert gradient_overlap(config(2, 2, True), cpus=2)
    assert not gradient_overlap(config(2, 2, False), cpus=8)
    assert Config.from_env({"HORA_GRADIENT_OVERLAP": "0"}).gradient_overlap is False
    assert Config.from_env({}).gradient_overlap is None
