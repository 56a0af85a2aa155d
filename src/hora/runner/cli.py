"""``horarun``: the command line, with ``horovodrun``'s flag spellings.

``horarun -np 4 python train.py`` runs ``python train.py`` as ranks 0-3 on this
machine; ``-H host1:2,host2:2`` or ``--hostfile FILE`` says where the ranks run
(``localhost:<np>`` by default; other hosts are reached over ssh). The tuning flags
become the ``HORA_*`` variables ``hora.config`` reads (see ``hora.runner.settings``);
``--config-file`` reads the same settings from horovodrun's YAML sections
(``hora.runner.config_file``), the command line winning. ``horarun --check-build``
prints what this installation can do; ``horarun doctor -H ...`` checks a cluster
(``hora.runner.doctor``).

A bad flag value prints one line naming the flag and the value and exits with code 2;
for the other exit codes see ``hora.runner.launch``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hora import config
from hora.runner import config_file
from hora.runner.arguments import USAGE_ERROR, Parser, number
from hora.runner.launch import launch
from hora.runner.settings import LaunchSettings, Tuning, parse_assignment
from hora.version import __version__

def _log_level(text: str) -> str:
    if text.upper() not in config.LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected one of {', '.join(config.LOG_LEVELS)}")
    return text.upper()


# Flags that only pass a value on to the ranks: destination -> (variable, how to write the value).
_PASS_ON: dict[str, tuple[str, Callable[[Any], str]]] = {
    "hierarchical_allreduce": ("HORA_HIERARCHICAL_ALLREDUCE", lambda v: "1" if v else "0"),
    "hierarchical_allgather": ("HORA_HIERARCHICAL_ALLGATHER", lambda v: "1" if v else "0"),
    "torus_allreduce": ("HORA_TORUS_ALLREDUCE", lambda v: "1" if v else "0"),
    "autotune": ("HORA_AUTOTUNE", lambda v: "1" if v else "0"),
    "autotune_log_file": ("HORA_AUTOTUNE_LOG", str),
    "autotune_warmup_samples": ("HORA_AUTOTUNE_WARMUP_SAMPLES", lambda v: str(int(v))),
    "autotune_steps_per_sample": ("HORA_AUTOTUNE_STEPS_PER_SAMPLE", lambda v: str(int(v))),
    "autotune_bayes_opt_max_samples": ("HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", lambda v: str(int(v))),
    "autotune_gaussian_process_noise": ("HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", repr),
    "timeline_filename": ("HORA_TIMELINE", str),
    "timeline_mark_cycles": ("HORA_TIMELINE_MARK_CYCLES", lambda v: "1" if v else "0"),
    "mpi_threads_disable": ("HORA_MPI_THREADS_DISABLE", lambda v: "1" if v else "0"),
    "num_nccl_streams": ("HORA_NUM_NCCL_STREAMS", lambda v: str(int(v))),
    "thread_affinity": ("HORA_THREAD_AFFINITY", str),
    "ccl_bgt_affinity": ("HOROVOD_CCL_BGT_AFFINITY", lambda v: str(int(v))),
    "tcp": ("NCCL_IB_DISABLE", lambda v: "1"),
}
_ELASTIC = ("min_num_proc", "max_num_proc", "slots_per_host", "elastic_timeout", "reset_limit",
            "blacklist_cooldown_range", "host_discovery_script")  # fmt: skip


def _flag(group: Any, *names: str, dest: str, help: str, const: Any = True) -> None:
    group.add_argument(*names, dest=dest, action="store_const", const=const, default=None, help=help)


def make_parser() -> argparse.ArgumentParser:
    """Returns the ``horarun`` argument parser."""
    parser = Parser(
        prog="horarun",
        description="Run a command as the ranks of a hora (Horovod-compatible) job. "
        "`horarun doctor -H HOSTS` checks a cluster instead.",
        usage="%(prog)s -np N [options] COMMAND [ARGS...]",
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--version", action="version", version=f"hora {__version__}")
    parser.add_argument("-np", "--num-proc", dest="num_proc", metavar="N", type=number(int, 1), help="number of ranks")
    parser.add_argument(
        "-cb", "--check-build", action="store_true", help="print the frameworks, transports and launchers available"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-H", "--hosts", metavar="HOSTS", help="hosts and their slots, e.g. host1:2,host2:4 (default localhost:<np>)"
    )
    where.add_argument("-hostfile", "--hostfile", metavar="FILE", help="file with one 'host slots=N' per line")
    parser.add_argument(
        "-p", "--ssh-port", metavar="PORT", type=number(int, 1, high=65535), help="ssh port of the hosts"
    )
    parser.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="private key ssh logs in with")
    parser.add_argument(
        "--network-interfaces",
        "--network-interface",
        dest="network_interfaces",
        metavar="NICS",
        help="interfaces ranks bind and advertise, first found wins, e.g. eth1,eth0 (default: the one that "
        "reaches the launcher; loopback on one host)",
    )
    parser.add_argument(
        "-x",
        dest="export",
        metavar="NAME[=VALUE]",
        action="append",
        default=[],
        help="forward NAME (or set it to VALUE) for every rank; repeatable",
    )
    parser.add_argument(
        "--env", dest="env", metavar="NAME=VALUE", action="append", default=[], help="set NAME=VALUE for every rank"
    )
    parser.add_argument(
        "--start-timeout",
        metavar="SECONDS",
        type=number(float, 0, strict=True),
        help="seconds ranks wait for each other at start-up (default: HORA_START_TIMEOUT or 30)",
    )
    parser.add_argument("--verbose", action="store_true", help="print the rank placement and the rendezvous port")
    parser.add_argument(
        "--output-filename", metavar="DIR", help="also write each rank's output to DIR/rank.<rank>/{stdout,stderr}"
    )
    parser.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_timestamp",
        action="store_true",
        help="put the time before each forwarded line",
    )
    parser.add_argument("--config-file", metavar="FILE", help="horovodrun's YAML settings (the command line wins)")
    controller = parser.add_mutually_exclusive_group()
    _flag(controller, "--gloo", dest="controller", const="gloo", help="hora's built-in transport (the default)")
    _flag(controller, "--mpi", dest="controller", const="mpi", help="start the ranks with mpirun; MPI carries the data")
    _flag(controller, "--jsrun", dest="controller", const="jsrun", help="IBM jsrun (not supported)")

    tuning = parser.add_argument_group("tuning (passed to the ranks as HORA_* variables)")
    for flag, metavar, parse, text in (
        ("--fusion-threshold-mb", "MB", number(float, 0), "fusion buffer size in MiB (0: off)"),
        ("--cycle-time-ms", "MS", number(float, 0), "ms to gather tensors before negotiating"),
        ("--cache-capacity", "N", number(int, 0), "response cache entries (0: off)"),
        ("--stall-check-warning-time-seconds", "SECONDS", number(float, 0, strict=True), "seconds before a warning"),
        ("--stall-check-shutdown-time-seconds", "SECONDS", number(float, 0), "seconds before shutdown (0: never)"),
        ("--log-level", "LEVEL", _log_level, f"one of {', '.join(config.LOG_LEVELS)}"),
        ("--autotune-log-file", "FILE", str, "where the autotuner logs its samples"),
        ("--autotune-warmup-samples", "N", number(int, 0), "samples the autotuner discards first"),
        ("--autotune-steps-per-sample", "N", number(int, 1), "steps per autotune sample"),
        ("--autotune-bayes-opt-max-samples", "N", number(int, 1), "samples of Bayesian optimisation"),
        ("--autotune-gaussian-process-noise", "X", number(float, 0, high=1), "noise in [0, 1]"),
        ("--timeline-filename", "FILE", str, "write a timeline (rank 0)"),
        ("--num-nccl-streams", "N", number(int, 1), "NCCL streams (GPU jobs)"),
        ("--thread-affinity", "CORES", str, "core of the engine thread per local rank"),
        ("--ccl-bgt-affinity", "CORE", number(int, 0), "oneCCL background thread core"),
        ("--gloo-timeout-seconds", "SECONDS", number(float, 0, strict=True), "as --start-timeout"),
    ):
        tuning.add_argument(flag, metavar=metavar, type=parse, default=None, help=text)
    _flag(tuning, "--disable-cache", dest="disable_cache", help="turn the response cache off")
    _flag(tuning, "--no-stall-check", dest="no_stall_check", help="turn the stall inspector off")
    _flag(tuning, "--log-without-timestamp", "--log-hide-timestamp", dest="log_without_timestamp",
          help="leave the time out of hora's log lines")  # fmt: skip
    _flag(tuning, "--autotune", dest="autotune", help="tune fusion and cycle time while training")
    _flag(tuning, "--timeline-mark-cycles", dest="timeline_mark_cycles", help="mark cycles in the timeline")
    _flag(tuning, "--mpi-threads-disable", dest="mpi_threads_disable", help="MPI without threads")
    _flag(tuning, "--tcp", dest="tcp", help="TCP only for NCCL (NCCL_IB_DISABLE=1)")
    for name in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        dest = name.replace("-", "_")
        _flag(tuning, f"--{name}", dest=dest, help=f"use the {name.replace('-', ' ')}")
        _flag(tuning, f"--no-{name}", dest=dest, const=False, help=f"do not use the {name.replace('-', ' ')}")
    mpi_only = parser.add_argument_group("MPI launch (with --mpi)")
    mpi_only.add_argument("--mpi-args", metavar="ARGS", default=None, help="extra mpirun arguments")
    mpi_only.add_argument("--binding-args", metavar="ARGS", default=None, help="mpirun binding arguments")
    elastic = parser.add_argument_group("elastic training (not built yet)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", metavar="N", default=None)
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", metavar="N", default=None)
    elastic.add_argument("--slots-per-host", "--slots", dest="slots_per_host", metavar="N", default=None)
    elastic.add_argument("--elastic-timeout", metavar="SECONDS", default=None)
    elastic.add_argument("--reset-limit", metavar="N", default=None)
    elastic.add_argument("--blacklist-cooldown-range", metavar=("MIN", "MAX"), nargs=2, default=None)
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


_CONFIGURABLE = {dest for keys in config_file.KEYS.values() for dest, _, _ in keys.values()} | {"controller"}


def parse_settings(argv: Sequence[str]) -> LaunchSettings | None:
    """Parses ``horarun``'s arguments.

    Args:
        argv: the arguments, without the program name.

    Returns:
        The launch settings, or None for ``--check-build`` (after printing its report).

    Raises:
        SystemExit: ``--help`` or ``--version`` (code 0), or a bad or missing
            argument (code 2, after one line on stderr).
    """
    parser = make_parser()
    args = parser.parse_args(list(argv))
    if args.check_build:
        from hora.runner.check_build import report

        print(report())
        return None
    given = {dest for dest in _CONFIGURABLE if getattr(args, dest, None) is not None}
    if args.config_file is not None:
        try:
            config_file.apply(args, args.config_file, given)
        except ValueError as exc:
            parser.error(str(exc))
    _refuse_unsupported(parser, args)
    if args.num_proc is None:
        parser.error("the following argument is required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected horarun -np N COMMAND [ARGS...]")
    env: dict[str, str] = {}
    forward: list[str] = []
    try:
        for text in args.export:
            name, value = parse_assignment(text, "-x")
            if value is None:
                forward.append(name)
            else:
                env[name] = value
        for text in args.env:
            name, value = parse_assignment(text, "--env")
            if value is None:
                raise ValueError(f"--env {text!r} is not valid: expected NAME=VALUE")
            env[name] = value
    except ValueError as exc:
        parser.error(str(exc))
    extra = {variable: write(getattr(args, dest)) for dest, (variable, write) in _PASS_ON.items()
             if getattr(args, dest, None) is not None}  # fmt: skip
    start_timeout = args.start_timeout if args.start_timeout is not None else args.gloo_timeout_seconds
    return LaunchSettings(
        command=tuple(args.command),
        num_proc=int(args.num_proc),
        hosts=args.hosts,
        hostfile=args.hostfile,
        start_timeout=start_timeout,
        verbose=args.verbose,
        output_filename=args.output_filename,
        prefix_timestamp=args.prefix_timestamp,
        tuning=Tuning(
            fusion_threshold_mb=args.fusion_threshold_mb,
            cycle_time_ms=args.cycle_time_ms,
            cache_capacity=None if args.cache_capacity is None else int(args.cache_capacity),
            disable_cache=bool(args.disable_cache),
            no_stall_check=bool(args.no_stall_check),
            stall_check_warning_time_seconds=args.stall_check_warning_time_seconds,
            stall_check_shutdown_time_seconds=args.stall_check_shutdown_time_seconds,
            log_level=args.log_level,
            log_without_timestamp=bool(args.log_without_timestamp),
            extra=extra,
        ),
        env=env,
        forward_env=tuple(forward),
        ssh_port=None if args.ssh_port is None else int(args.ssh_port),
        ssh_identity_file=args.ssh_identity_file,
        network_interfaces=args.network_interfaces,
        mpi=args.controller == "mpi",
        mpi_args=" ".join(part for part in (args.mpi_args, args.binding_args) if part) or None,
    )


def _refuse_unsupported(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.controller == "jsrun":
        parser.error("--jsrun: IBM jsrun is not supported: use -H/--hostfile (ssh) or start the ranks with mpirun")
    for dest in ("mpi_args", "binding_args"):
        if getattr(args, dest) is not None and args.controller != "mpi":
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag} applies to --mpi only: add --mpi or drop {flag}")
    for dest in _ELASTIC:
        if getattr(args, dest) is not None:
            parser.error(
                f"--{dest.replace('_', '-')}: elastic training is not built yet: run a fixed -np job "
                "without the elastic flags"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``horarun``.

    Args:
        argv: the arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 on success, 2 for a usage error, otherwise as
        ``hora.runner.launch.launch`` returns.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["doctor"]:
        from hora.runner.doctor import main as doctor_main

        return doctor_main(arguments[1:])
    try:
        settings = parse_settings(arguments)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else USAGE_ERROR)
    if settings is None:
        return 0
    try:
        return launch(settings)
    except ValueError as exc:
        print(f"horarun: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
