"""Every variable hora reads, declared once.

A ``Knob`` says everything there is to know about one setting: its ``HORA_*`` name and
Horovod's names for it, how its text is parsed and checked, its default, the ``Config``
field it fills, the ``horarun`` flags and ``--config-file`` key that set it, and what it
means. Everything else is derived from ``KNOBS``:

* ``hora.config.Config.from_env`` reads the knobs that have a ``field``;
* ``hora.runner.cli`` makes a flag for each ``Option`` and ``hora.runner.config_file``
  maps each ``yaml`` key to it;
* ``hora.runner.settings.Tuning`` writes the flags' values as the variables;
* the tables of docs/configuration.md are ``markdown(section)`` (``python -m hora.config
  docs/configuration.md`` rewrites them; a test checks that they agree).

Reading a variable: the ``HORA_*`` name wins over Horovod's names; a value outside what
the knob accepts raises ``ValueError`` naming the variable, the value and what is
accepted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

MIB = 1024 * 1024
DEFAULT_FUSION_THRESHOLD = 128 * MIB
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


# ----- kinds: how a value is parsed from text, checked and written back -----


@dataclasses.dataclass(frozen=True)
class Integer:
    """An integer in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""

    lo: int = 0
    hi: int | None = None
    yaml_type: type = int

    @property
    def accepted(self) -> str:
        return f"an integer >= {self.lo}" if self.hi is None else f"an integer in [{self.lo}, {self.hi}]"

    def check(self, value: Any) -> int:
        if value < self.lo or (self.hi is not None and value > self.hi):
            raise ValueError(self.accepted)
        return int(value)

    def parse(self, text: str) -> int:
        return self.check(int(text))

    def write(self, value: Any) -> str:
        return str(int(value))


@dataclasses.dataclass(frozen=True)
class Number:
    """A finite number ``>= lo`` (``> lo`` when strict), ``<= hi`` when given."""

    lo: float = 0.0
    strict: bool = False
    hi: float | None = None
    yaml_type: type = float

    @property
    def accepted(self) -> str:
        if self.hi is not None:
            return f"a number in [{self.lo:g}, {self.hi:g}]"
        return f"a number {'>' if self.strict else '>='} {self.lo:g}"

    def check(self, value: Any) -> float:
        number = float(value)
        if not math.isfinite(number) or number < self.lo or (self.strict and number == self.lo):
            raise ValueError(self.accepted)
        if self.hi is not None and number > self.hi:
            raise ValueError(self.accepted)
        return number

    def parse(self, text: str) -> float:
        return self.check(float(text))

    def write(self, value: Any) -> str:
        return repr(float(value))


@dataclasses.dataclass(frozen=True)
class Boolean:
    """A flag: ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` (any case)."""

    yaml_type: type = bool
    accepted: str = "one of 1, 0, true, false, yes, no, on, off"

    def check(self, value: Any) -> bool:
        return bool(value)

    def parse(self, text: str) -> bool:
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(self.accepted)

    def write(self, value: Any) -> str:
        return "1" if value else "0"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``choices`` (or a synonym's choice), in any case; the value is the declared spelling.

    ``synonyms`` maps other spellings (an alias's, such as Horovod's ``gloo``) to choices.
    """

    choices: tuple[str, ...]
    yaml_type: type = str
    synonyms: tuple[tuple[str, str], ...] = ()

    @property
    def accepted(self) -> str:
        also = "".join(f", {word} (= {choice})" for word, choice in self.synonyms)
        return "one of " + ", ".join(self.choices) + also

    def check(self, value: Any) -> str:
        for choice in self.choices:
            if str(value).upper() == choice.upper():
                return choice
        for word, choice in self.synonyms:
            if str(value).upper() == word.upper():
                return choice
        raise ValueError(self.accepted)

    def parse(self, text: str) -> str:
        return self.check(text)

    def write(self, value: Any) -> str:
        return str(value)


@dataclasses.dataclass(frozen=True)
class Text:
    """Any text; empty counts as unset."""

    yaml_type: type = str
    accepted: str = "text"

    def check(self, value: Any) -> str | None:
        return str(value) or None

    def parse(self, text: str) -> str | None:
        return self.check(text)

    def write(self, value: Any) -> str:
        return str(value)


@dataclasses.dataclass(frozen=True)
class Cores:
    """Comma-separated CPU core numbers, one per local rank; empty counts as unset."""

    yaml_type: type = str
    accepted: str = "comma-separated core numbers, one per local rank"

    def check(self, value: Any) -> tuple[int, ...]:
        text = str(value).strip()
        if not text:
            return ()
        try:
            cores = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(self.accepted) from None
        if any(core < 0 for core in cores):
            raise ValueError(self.accepted)
        return cores

    def parse(self, text: str) -> tuple[int, ...]:
        return self.check(text)

    def write(self, value: Any) -> str:
        return value if isinstance(value, str) else ",".join(str(core) for core in value)


Kind = Integer | Number | Boolean | Choice | Text | Cores


# ----- declarations -----


@dataclasses.dataclass(frozen=True)
class Option:
    """A ``horarun`` flag that sets a knob.

    Attributes:
        names: the flag's spellings (horovodrun's first).
        help: one line for ``horarun --help``.
        metavar: what the flag takes; None for a flag that takes nothing and sets ``const``.
        const: the knob's value a flag without ``metavar`` sets.
        kind: how the flag's text is parsed; None: as the knob's variable.
        scale: the variable's value is the flag's times this (MiB flags of byte knobs).
    """

    names: tuple[str, ...]
    help: str
    metavar: str | None = None
    const: Any = True
    kind: Kind | None = None
    scale: int = 1


@dataclasses.dataclass(frozen=True)
class Knob:
    """One variable hora reads (or ``horarun`` passes on).

    Attributes:
        name: the variable (``HORA_*``, or another program's for knobs only passed on).
        kind: how its text is parsed and checked.
        default: its value when unset; None where hora decides at run time.
        section: the table of docs/configuration.md it is in (one of ``SECTIONS``).
        doc: what it means, for the docs.
        aliases: Horovod's names for it, in order of preference.
        field: the ``Config`` attribute it fills (``extras.<name>`` for ``Extras``);
            None when read by hand (the topology, checked as a whole) or not by ranks.
        field_unit: the field holds the value times this (MiB variables of byte fields).
        options: the ``horarun`` flags that set it.
        yaml: its ``section.key`` in ``horarun --config-file``.
        yaml_invert: the key means the opposite (``stall_check.enabled``).
        shown_default: the default as the docs say it, when ``default`` does not say it.
    """

    name: str
    kind: Kind
    default: Any
    section: str
    doc: str
    aliases: tuple[str, ...] = ()
    field: str | None = None
    field_unit: int = 1
    options: tuple[Option, ...] = ()
    yaml: str | None = None
    yaml_invert: bool = False
    shown_default: str | None = None

    @property
    def dest(self) -> str:
        """The ``argparse`` destination its flags share."""
        return self.name.lower()

    def lookup(self, environ: Mapping[str, str]) -> tuple[str, str] | None:
        """Returns (the variable found, its stripped value), or None when none is set."""
        for candidate in (self.name, *self.aliases):
            value = environ.get(candidate)
            if value is not None:
                return candidate, value.strip()
        return None

    def read(self, environ: Mapping[str, str], default: Any = ...) -> Any:
        """Returns the knob's value in ``environ``, or ``default`` (the knob's) when unset.

        Raises:
            ValueError: the value is not one the knob accepts; names the variable,
                the value and what is accepted.
        """
        fallback = self.default if default is ... else default
        found = self.lookup(environ)
        if found is None:
            return fallback
        var, text = found
        try:
            value = self.kind.parse(text)
        except ValueError:
            raise ValueError(f"{var}={text!r} is not valid: expected {self.kind.accepted}") from None
        return fallback if value is None or value == () else value

    def from_option(self, option: Option, value: Any) -> Any:
        """The knob's value for a flag's (or config file key's) parsed value."""
        if option.scale == 1:
            return value
        scaled = value * option.scale
        return int(scaled) if isinstance(self.kind, Integer) else scaled


# The tables of docs/configuration.md, in its order.
SECTIONS = ("runtime", "data plane", "without effect", "passed on", "topology", "launcher")


def _on_off(name: str, what: str) -> tuple[Option, Option]:
    return (Option((f"--{name}",), f"use the {what}"), Option((f"--no-{name}",), f"do not use the {what}", const=False))


def _topology(name: str, kind: Kind, doc: str, *aliases: str) -> Knob:
    return Knob(name, kind, None, "topology", doc, aliases, shown_default="")


KNOBS: tuple[Knob, ...] = (
    # runtime
    Knob("HORA_FUSION_THRESHOLD", Integer(), DEFAULT_FUSION_THRESHOLD, "runtime",
         "largest fused allreduce, bytes; 0 disables fusion", ("HOROVOD_FUSION_THRESHOLD",), "fusion_threshold",
         options=(Option(("--fusion-threshold-mb",), "fusion buffer size in MiB (0: off)", "MB", kind=Number(),
                         scale=MIB),),
         yaml="params.fusion_threshold_mb"),
    Knob("HORA_CYCLE_TIME", Number(), 0.0, "runtime",
         "ms the engine waits after a submit for more tensors to fuse with; 0: no fixed cycle (a tensor "
         "goes out at once, or with the engine's next pass while others of its rank are in flight)",
         ("HOROVOD_CYCLE_TIME",), "cycle_time_ms",
         options=(Option(("--cycle-time-ms",), "ms to gather tensors before negotiating", "MS"),),
         yaml="params.cycle_time_ms"),
    Knob("HORA_GRADIENT_OVERLAP", Boolean(), None, "runtime",
         "PyTorch's `DistributedOptimizer` (without `groups`): 1 starts each gradient's allreduce as backward "
         "computes it, beside the rest of backward (Horovod's way); 0 starts them together when `step()` or "
         "`synchronize()` needs them, negotiated and fused as one. Unset: 0 when every rank of the job is on "
         "this machine and there are at least as many of them as usable CPUs (the reductions then run on the "
         "cores backward needs, and one costs less CPU than one per gradient), else 1",
         field="gradient_overlap", shown_default="unset"),
    Knob("HORA_CACHE_CAPACITY", Integer(), 1024, "runtime",
         "how many distinct tensors the response cache holds (the first ones seen; 0 disables it): a cached "
         "tensor sent unchanged negotiates by id and skips cross-rank validation; with every rank on one "
         "machine, a lone allreduce, a whole grouped call of them or a batch of lone ones announced together "
         "skips the coordinator too (the fast lane, docs/architecture.md)",
         ("HOROVOD_CACHE_CAPACITY",), "cache_capacity",
         options=(Option(("--cache-capacity",), "response cache entries (0: off)", "N"),
                  Option(("--disable-cache",), "turn the response cache off", const=0)),
         yaml="params.cache_capacity"),
    Knob("HORA_SPIN_US", Integer(0, 1_000_000), None, "runtime",
         "microseconds a rank's threads keep polling after work before they sleep (waking from sleep costs "
         "tens of microseconds on each side), and a shared-memory barrier inside a data phase before it sleeps "
         "(at least 50); 0 where ranks get less CPU than the machine shows them (CPU "
         "quotas, several emulated hosts on one machine), where a polling rank takes the CPU its peer needs",
         (), "spin_us", shown_default="300, or 0 with more local ranks than cores"),
    Knob("HORA_SOCKET_BUFFER_BYTES", Integer(0, 1 << 30), 0, "runtime",
         "send and receive buffer of each TCP data link, set on both ends (SO_SNDBUF and SO_RCVBUF, as Open "
         "MPI's btl_tcp_sndbuf/rcvbuf); 0 leaves them to the kernel's autotuning. 1 MiB made 64 MiB "
         "allreduces 20-30% faster on 8 emulated hosts at 10 Gbit/s, and slowed TCP on one machine "
         "(docs/performance.md)", (), "socket_buffer_bytes"),
    Knob("HORA_RIDE_BYTES", Integer(0, 1 << 16), 4096, "runtime",
         "bytes of small allreduce and broadcast data a rank sends to the coordinator along with one frame of "
         "requests; when every member's data is there, rank 0 computes the result and sends it back with the "
         "response, and no data phase runs (docs/architecture.md, riders; 0 turns it off)", (), "ride_bytes"),
    Knob("HORA_STALL_CHECK_DISABLE", Boolean(), False, "runtime", "turn the stall inspector off",
         ("HOROVOD_STALL_CHECK_DISABLE",), "stall_check_disable",
         options=(Option(("--no-stall-check",), "turn the stall inspector off"),
                  Option(("--stall-check",), "keep the stall inspector on", const=False)),
         yaml="stall_check.enabled", yaml_invert=True),
    Knob("HORA_STALL_CHECK_TIME_SECONDS", Number(strict=True), 60.0, "runtime",
         "seconds before rank 0 warns about tensors some ranks have not submitted, and before any rank warns "
         "about a collective whose data stopped moving (naming the ranks it waits for), and before a worker "
         "waiting for rank 0's responses with nothing from it asks whether it is there",
         ("HOROVOD_STALL_CHECK_TIME_SECONDS",), "stall_check_time_seconds",
         options=(Option(("--stall-check-warning-time-seconds",), "seconds before a stall warning", "SECONDS"),),
         yaml="stall_check.warning_time_seconds"),
    Knob("HORA_STALL_SHUTDOWN_TIME_SECONDS", Number(), 0.0, "runtime",
         "seconds after which such a stall fails the job on every rank (a data-phase stall a few seconds later: "
         "the ranks first ping each other to name the frozen ones); 0 (or a value not above the warning time) "
         "never", ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",), "stall_shutdown_time_seconds",
         options=(Option(("--stall-check-shutdown-time-seconds",), "seconds before a stall fails the job (0: never)",
                         "SECONDS"),),
         yaml="stall_check.shutdown_time_seconds"),
    Knob("HORA_LOG_LEVEL", Choice(LOG_LEVELS), "WARNING", "runtime",
         "the level of the `hora` logger (each module logs as `hora.<module>`; records propagate to the "
         "application's handlers, and hora writes its own lines to stderr only while the application has "
         "configured no logging; a record about a rank carries it as `%(rank)s`)",
         ("HOROVOD_LOG_LEVEL",), "log_level",
         options=(Option(("--log-level",), "one of " + ", ".join(LOG_LEVELS), "LEVEL"),), yaml="logging.level"),
    Knob("HORA_LOG_HIDE_TIME", Boolean(), False, "runtime", "leave the time out of hora's log lines",
         ("HOROVOD_LOG_HIDE_TIME",), "log_hide_time",
         options=(Option(("--log-without-timestamp", "--log-hide-timestamp"), "leave the time out of log lines"),
                  Option(("--log-with-timestamp", "--no-log-hide-timestamp"), "put the time in log lines",
                         const=False)),
         yaml="logging.hide_timestamp"),
    Knob("HORA_DYNAMIC_PROCESS_SETS", Boolean(), False, "runtime",
         "allow `add_process_set`/`remove_process_set` after `init()`", ("HOROVOD_DYNAMIC_PROCESS_SETS",),
         "dynamic_process_sets"),
    Knob("HORA_ELASTIC", Boolean(), False, "runtime",
         "the job is elastic (horarun sets it in an elastic job); as in Horovod, a DistributedOptimizer of a "
         "single rank then still reduces", ("HOROVOD_ELASTIC",), "elastic"),
    Knob("HORA_ELASTIC_TIMEOUT", Number(strict=True), 600.0, "runtime",
         "seconds an elastic job waits for `--min-np` slots (horarun's `--elastic-timeout`), and a worker, "
         "plus the start timeout, for its place in the next world", ("HOROVOD_ELASTIC_TIMEOUT",),
         "elastic_timeout"),
    Knob("HORA_START_TIMEOUT", Number(strict=True), 30.0, "runtime",
         "seconds a rank waits at start-up for the others to reach the rendezvous and connect",
         ("HOROVOD_START_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"), "start_timeout",
         options=(Option(("--start-timeout",), "seconds ranks wait for each other at start-up", "SECONDS"),
                  Option(("--gloo-timeout-seconds",), "as --start-timeout", "SECONDS")),
         yaml="library_options.gloo_timeout_seconds"),
    Knob("HORA_DISABLE_GROUP_FUSION", Boolean(), False, "runtime",
         "read and validated; grouped collectives always negotiate as one group",
         ("HOROVOD_DISABLE_GROUP_FUSION",), "disable_group_fusion"),
    Knob("HORA_AUTOTUNE", Boolean(), False, "runtime",
         "tune the fusion threshold, the cycle time and the shared-memory staging size while training (rank 0 "
         "scores samples of training steps by bytes allreduced per second, Bayesian optimisation picks the next "
         "point, every rank switches at the same collective; the ones set by hand stay as set): docs/autotune.md",
         ("HOROVOD_AUTOTUNE",), "autotune",
         options=(Option(("--autotune",), "tune fusion, cycle time and staging size while training"),
                  Option(("--no-autotune",), "do not tune", const=False)),
         yaml="autotune.enabled"),
    Knob("HORA_AUTOTUNE_LOG", Text(), None, "runtime",
         "a CSV file rank 0 writes a row to for each autotune sample (Horovod's columns: the parameters and "
         "the score in bytes per second; then hora's staging size)", ("HOROVOD_AUTOTUNE_LOG",), "autotune_log",
         options=(Option(("--autotune-log-file",), "where the autotuner logs its samples", "FILE"),),
         yaml="autotune.log_file"),
    Knob("HORA_AUTOTUNE_WARMUP_SAMPLES", Integer(), 3, "runtime",
         "autotune samples discarded at the start", ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",),
         "autotune_warmup_samples",
         options=(Option(("--autotune-warmup-samples",), "samples the autotuner discards first", "N"),),
         yaml="autotune.warmup_samples"),
    Knob("HORA_AUTOTUNE_STEPS_PER_SAMPLE", Integer(1), 10, "runtime",
         "training steps per autotune sample (a step ends when a tensor name comes round again)",
         ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",), "autotune_steps_per_sample",
         options=(Option(("--autotune-steps-per-sample",), "steps per autotune sample", "N"),),
         yaml="autotune.steps_per_sample"),
    Knob("HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", Integer(1), 20, "runtime",
         "autotune samples scored (after the warm-up) before it settles on the best",
         ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",), "autotune_bayes_opt_max_samples",
         options=(Option(("--autotune-bayes-opt-max-samples",), "samples of Bayesian optimisation", "N"),),
         yaml="autotune.bayes_opt_max_samples"),
    Knob("HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", Number(hi=1.0), 0.8, "runtime",
         "the noise of the autotuner's Gaussian process, in units of the scores' variance (higher: trusts "
         "one sample less)", ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",), "autotune_gaussian_process_noise",
         options=(Option(("--autotune-gaussian-process-noise",), "noise in [0, 1]", "X"),),
         yaml="autotune.gaussian_process_noise"),
    # data plane
    Knob("HORA_TRANSPORT", Choice(("builtin", "mpi"), synonyms=(("gloo", "builtin"),)), "builtin", "data plane",
         "`builtin`: hora's shared memory and TCP; `mpi`: collectives through mpi4py, for jobs started by "
         "`mpirun` (`horarun --mpi` sets it). Horovod's `HOROVOD_CPU_OPERATIONS` names them `gloo` and `mpi`; "
         "its `HOROVOD_CONTROLLER` (the library that coordinates, where hora always coordinates itself) "
         "counts where `HOROVOD_CPU_OPERATIONS` is unset", ("HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER"), "transport"),
    Knob("HORA_SHARED_MEMORY", Boolean(), True, "data plane",
         "ranks on one machine move data through shared memory; 0 forces TCP", field="shared_memory"),
    Knob("HORA_SHM_STAGING_MB", Integer(1, 4096), None, "data plane",
         "each rank's shared staging area (two halves), MiB: small keeps a round in cache; large means fewer "
         "barriers when ranks take turns on the cores. Unset with autotune on: tuned (docs/autotune.md)",
         field="shm_staging_bytes", field_unit=MIB,
         shown_default="2, or 16 with more local ranks than cores"),
    Knob("HORA_HIERARCHICAL_ALLREDUCE", Boolean(), None, "data plane",
         "unset: hierarchical allreduce for every process set whose layout suits it (several hosts, the same "
         "number of ranks on each, more than one per host); 1 or 0 forces it on or off",
         ("HOROVOD_HIERARCHICAL_ALLREDUCE",), "hierarchical_allreduce",
         options=_on_off("hierarchical-allreduce", "hierarchical allreduce"), yaml="params.hierarchical_allreduce"),
    Knob("HORA_HIERARCHICAL_ALLGATHER", Boolean(), None, "data plane",
         "the same for allgather: cross-host ring between ranks with the same local index, then a shared-memory "
         "allgather within each host. Horovod's default is off; hora's is on where the layout suits it, as for "
         "allreduce", ("HOROVOD_HIERARCHICAL_ALLGATHER",), "hierarchical_allgather",
         options=_on_off("hierarchical-allgather", "hierarchical allgather"), yaml="params.hierarchical_allgather"),
    Knob("HORA_THREAD_AFFINITY", Cores(), (), "data plane",
         "comma-separated CPU cores, one per local rank: the core the rank's engine thread is pinned to",
         ("HOROVOD_THREAD_AFFINITY",), "thread_affinity",
         options=(Option(("--thread-affinity",), "core of the engine thread per local rank", "CORES"),),
         yaml="library_options.thread_affinity", shown_default="unset"),
    Knob("HORA_TIMELINE", Text(), None, "data plane",
         "a file rank 0 writes a timeline to (a Chrome trace: open it in `chrome://tracing` or Perfetto), or "
         "`DYNAMIC` to record only between `hvd.start_timeline(path)` and `hvd.stop_timeline()` (which also "
         "work without it)", ("HOROVOD_TIMELINE",), "timeline",
         options=(Option(("--timeline-filename",), "write a timeline (rank 0)", "FILE"),), yaml="timeline.filename"),
    Knob("HORA_TIMELINE_MARK_CYCLES", Boolean(), False, "data plane",
         "mark each busy pass of the engine loop in the timeline", ("HOROVOD_TIMELINE_MARK_CYCLES",),
         "timeline_mark_cycles", options=(Option(("--timeline-mark-cycles",), "mark cycles in the timeline"),
                                          Option(("--no-timeline-mark-cycles",), "do not mark cycles", const=False)),
         yaml="timeline.mark_cycles"),
    # without effect: read and validated so a Horovod job's settings carry over
    Knob("HORA_TORUS_ALLREDUCE", Boolean(), False, "without effect", "Horovod's torus allreduce for NCCL",
         ("HOROVOD_TORUS_ALLREDUCE",), "extras.torus_allreduce",
         options=_on_off("torus-allreduce", "torus allreduce"), yaml="params.torus_allreduce"),
    Knob("HORA_NUM_NCCL_STREAMS", Integer(1), 1, "without effect", "NCCL streams (GPU jobs)",
         ("HOROVOD_NUM_NCCL_STREAMS",), "extras.num_nccl_streams",
         options=(Option(("--num-nccl-streams",), "NCCL streams (GPU jobs)", "N"),),
         yaml="library_options.num_nccl_streams"),
    Knob("HORA_MPI_THREADS_DISABLE", Boolean(), False, "without effect", "MPI without threads",
         ("HOROVOD_MPI_THREADS_DISABLE",), "extras.mpi_threads_disable",
         options=(Option(("--mpi-threads-disable",), "MPI without threads"),
                  Option(("--no-mpi-threads-disable",), "MPI with threads", const=False)),
         yaml="library_options.mpi_threads_disable"),
    # passed on: horarun sets them for libraries a rank may load; hora does not read them
    Knob("HOROVOD_CCL_BGT_AFFINITY", Integer(), None, "passed on", "oneCCL's background thread core",
         options=(Option(("--ccl-bgt-affinity",), "oneCCL background thread core", "CORE"),),
         yaml="library_options.ccl_bgt_affinity", shown_default="unset"),
    Knob("NCCL_IB_DISABLE", Boolean(), None, "passed on", "NCCL over TCP only (no InfiniBand)",
         options=(Option(("--tcp",), "TCP only for NCCL (NCCL_IB_DISABLE=1)"),), shown_default="unset"),
    # topology: written by horarun under both names; read by hora.config as a whole
    _topology("HORA_RANK", Integer(), "this rank", "HOROVOD_RANK"),
    _topology("HORA_SIZE", Integer(1), "the number of ranks", "HOROVOD_SIZE"),
    _topology("HORA_LOCAL_RANK", Integer(), "this rank's index on its host", "HOROVOD_LOCAL_RANK"),
    _topology("HORA_LOCAL_SIZE", Integer(1), "the number of ranks on this host", "HOROVOD_LOCAL_SIZE"),
    _topology("HORA_CROSS_RANK", Integer(), "index of this host among the hosts with this local rank",
              "HOROVOD_CROSS_RANK"),
    _topology("HORA_CROSS_SIZE", Integer(1), "the number of hosts with this local rank", "HOROVOD_CROSS_SIZE"),
    _topology("HORA_HOSTNAME", Text(), "the host name peers use in messages", "HOROVOD_HOSTNAME"),
    _topology("HORA_RENDEZVOUS_ADDR", Text(), "the job's rendezvous server address",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR"),
    _topology("HORA_RENDEZVOUS_PORT", Integer(0, 65535), "the job's rendezvous server port (0: none)",
              "HOROVOD_GLOO_RENDEZVOUS_PORT"),
    _topology("HORA_SECRET", Text(), "the job secret, hex (at least 32 digits); every connection proves it "
              "holds it"),
    _topology("HORA_SECRET_FILE", Text(), "a file that holds the secret (used when `HORA_SECRET` is unset): "
              "a Kubernetes secret mounted as a file, say"),
    Knob("HORA_ELASTIC_GENERATION", Integer(), None, "topology",
         "set by horarun's elastic driver: the world this worker was started for; `init()` then takes its rank "
         "from the driver, not from the variables above", field="elastic_generation", shown_default=""),
    Knob("HORA_RUN_STORE_ADDR", Text(), None, "topology",
         "set by `hora.run` under `use_mpi`: the address of the store that serves the call (else the store is at "
         "`HORA_RENDEZVOUS_ADDR`)", shown_default=""),
    Knob("HORA_RUN_STORE_PORT", Integer(1, 65535), None, "topology",
         "set by `hora.run`: the port of the store that serves the call to each rank and takes its result",
         shown_default=""),
    Knob("HORA_RUN_SECRET", Text(), None, "topology",
         "set by `hora.run`: the store's secret, hex", shown_default=""),
    Knob("HORA_IFACE", Text(), None, "topology",
         "comma-separated interfaces; the rank binds and advertises the address of the first one its host has "
         "(`horarun --network-interfaces`)", ("HOROVOD_GLOO_IFACE",), "iface", shown_default=""),
    # launcher side
    Knob("HORA_SSH_OPTIONS", Text(), None, "launcher",
         "extra `ssh` arguments for reaching remote hosts, split as a shell would, e.g. "
         "`-F ~/.ssh/cluster_config`", shown_default="unset"),
    Knob("HORA_BIND_TO", Choice(("none", "core")), "none", "launcher",
         "`core`: horarun pins each rank (and what it starts) to its own contiguous block of its host's cores, "
         "as `mpirun --bind-to core` does; a host with more ranks than CPUs stays unbound (docs/launching.md)",
         options=(Option(("--bind-to",), "pin each rank to its own block of cores: core or none", "WHAT"),)),
    Knob("HORA_SPARK_START_TIMEOUT", Number(strict=True), 600.0, "launcher",
         "seconds `hora.spark.run` waits for Spark to start every task of its stage (its `start_timeout` "
         "argument wins)", ("HOROVOD_SPARK_START_TIMEOUT",)),
)

BY_NAME: Mapping[str, Knob] = {knob.name: knob for knob in KNOBS}


def read(name: str, environ: Mapping[str, str], default: Any = ...) -> Any:
    """Reads the knob ``name`` from ``environ`` (see ``Knob.read``).

    Raises:
        KeyError: no knob has that name.
        ValueError: the value is not one the knob accepts.
    """
    return BY_NAME[name].read(environ, default)


def names() -> list[str]:
    """Every variable name hora reads, hora's and Horovod's."""
    return [name for knob in KNOBS for name in (knob.name, *knob.aliases)]


# ----- the docs' tables -----


def _shown(knob: Knob) -> str:
    if knob.shown_default is not None:
        return knob.shown_default
    if knob.default is None:
        return "unset"
    if isinstance(knob.kind, Boolean):
        return "1" if knob.default else "0"
    if isinstance(knob.default, float) and knob.default.is_integer():
        return str(int(knob.default))
    return str(knob.default)


def _setters(knob: Knob) -> str:
    flags = [
        "`" + "`/`".join(option.names) + (f" {option.metavar}`" if option.metavar else "`")
        for option in knob.options
    ]
    if knob.yaml:
        flags.append(f"`{knob.yaml}`" + (" (inverted)" if knob.yaml_invert else ""))
    return ", ".join(flags)


def markdown(section: str) -> str:
    """Returns the docs' table of one section of ``SECTIONS``."""
    rows = ["| variable | Horovod alias | default | `horarun` flag, config-file key | meaning |",
            "|---|---|---|---|---|"]  # fmt: skip
    for knob in KNOBS:
        if knob.section == section:
            aliases = ", ".join(f"`{alias}`" for alias in knob.aliases) or "none"
            cells = (f"`{knob.name}`", aliases, _shown(knob) or "-", _setters(knob) or "none", knob.doc)
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


_BLOCK = re.compile(r"(<!-- knobs: (?P<section>[a-z ]+) -->\n)(?P<body>.*?)(<!-- end knobs -->)", re.S)


def render(document: str) -> str:
    """Returns ``document`` with each ``<!-- knobs: SECTION -->`` block holding its table.

    Raises:
        KeyError: a block names a section that does not exist.
    """

    def table(match: re.Match[str]) -> str:
        section = match["section"]
        if section not in SECTIONS:
            raise KeyError(f"no knob section {section!r}: expected one of {', '.join(SECTIONS)}")
        return match[1] + markdown(section) + match[4]

    return _BLOCK.sub(table, document)
