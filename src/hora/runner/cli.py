"""``horarun``: the command line, with ``horovodrun``'s flag spellings.

``horarun -np 4 python train.py`` runs ``python train.py`` as ranks 0-3 on this
machine; ``-H host1:2,host2:2`` or ``--hostfile FILE`` says where the ranks run
(``localhost:<np>`` by default; other hosts are reached over ssh). Every knob
flag is declared with its variable in ``hora.config.knobs`` and reaches the ranks as
that variable (``hora.runner.settings.Tuning``);
``--config-file`` reads the same settings from horovodrun's YAML sections
(``hora.runner.config_file``), the command line winning. ``horarun --check-build``
prints what this installation can do; ``horarun doctor -H ...`` checks a cluster
(``hora.runner.doctor``).

A bad flag value prints one line naming the flag and the value and exits with code 2;
for the other exit codes see ``hora.runner.launch``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hora.config import knobs
from hora.runner import config_file
from hora.runner.arguments import USAGE_ERROR, Parser, number
from hora.runner.elastic.settings import ElasticSettings
from hora.runner.launch import launch
from hora.runner.settings import LaunchSettings, Tuning, parse_assignment
from hora.version import __version__

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

    _add_knob_flags(parser)
    mpi_only = parser.add_argument_group("MPI launch (with --mpi)")
    mpi_only.add_argument("--mpi-args", metavar="ARGS", default=None, help="extra mpirun arguments")
    mpi_only.add_argument("--binding-args", metavar="ARGS", default=None, help="mpirun binding arguments")
    elastic = parser.add_argument_group("elastic training (docs/elastic.md)")
    count = number(int, 1)
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", metavar="N", type=count, default=None,
                         help="the fewest ranks the job runs with (makes the job elastic)")  # fmt: skip
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", metavar="N", type=count, default=None,
                         help="the most ranks (default: every slot discovered)")  # fmt: skip
    elastic.add_argument("--slots-per-host", "--slots", dest="slots_per_host", metavar="N", type=count, default=None,
                         help="slots of a discovered host listed without a count")  # fmt: skip
    elastic.add_argument("--elastic-timeout", metavar="SECONDS", type=count, default=None,
                         help="seconds to wait for --min-np slots (default 600, or HOROVOD_ELASTIC_TIMEOUT)")  # fmt: skip
    elastic.add_argument("--reset-limit", metavar="N", type=number(int, 0), default=None,
                         help="the most resets before the job stops (default: no limit)")  # fmt: skip
    elastic.add_argument("--blacklist-cooldown-range", metavar=("MIN", "MAX"), nargs=2, type=count, default=None,
                         help="a failed host comes back after MIN to MAX seconds (default: never)")  # fmt: skip
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT", default=None,
                         help="a command that prints the available hosts, one HOST[:SLOTS] per line")  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


def _add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """Adds a flag for every ``Option`` of ``hora.config.knobs``; a knob's flags share its dest."""
    group = parser.add_argument_group("knobs (passed to the ranks as the variables of docs/configuration.md)")
    for knob in knobs.KNOBS:
        target = group.add_mutually_exclusive_group() if len(knob.options) > 1 else group
        for option in knob.options:
            if option.metavar is None:
                target.add_argument(*option.names, dest=knob.dest, action="store_const", const=option.const,
                                    default=None, help=option.help)  # fmt: skip
            else:
                target.add_argument(*option.names, dest=knob.dest, metavar=option.metavar,
                                    type=_option_type(knob, option), default=None, help=option.help)  # fmt: skip


def _option_type(knob: knobs.Knob, option: knobs.Option) -> Callable[[str], Any]:
    """The argparse type of a flag: its text parsed and checked, in the knob's units."""
    kind = option.kind or knob.kind

    def parse(text: str) -> Any:
        try:
            return knob.from_option(option, kind.parse(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {kind.accepted}") from None

    return parse


def _knob_values(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs the command line (or the config file) set, by variable name."""
    return {knob.name: getattr(args, knob.dest) for knob in knobs.KNOBS
            if knob.options and getattr(args, knob.dest, None) is not None}  # fmt: skip


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
    given = {knobs.BY_NAME[name].dest for name in _knob_values(args)}
    if args.controller is not None:
        given.add("controller")
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
    values = _knob_values(args)
    start_timeout = values.pop("HORA_START_TIMEOUT", None)
    try:
        elastic = _elastic_settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    return LaunchSettings(
        command=tuple(args.command),
        num_proc=int(args.num_proc),
        hosts=args.hosts,
        hostfile=args.hostfile,
        start_timeout=start_timeout,
        verbose=args.verbose,
        output_filename=args.output_filename,
        prefix_timestamp=args.prefix_timestamp,
        tuning=Tuning(values),
        env=env,
        forward_env=tuple(forward),
        ssh_port=None if args.ssh_port is None else int(args.ssh_port),
        ssh_identity_file=args.ssh_identity_file,
        network_interfaces=args.network_interfaces,
        mpi=args.controller == "mpi",
        mpi_args=" ".join(part for part in (args.mpi_args, args.binding_args) if part) or None,
        elastic=elastic,
    )


def _elastic_settings(args: argparse.Namespace) -> ElasticSettings | None:
    """The elastic flags, checked; None for a job that is not elastic.

    Raises:
        ValueError: the flags contradict each other or apply only to an elastic job.
    """
    timeout = args.elastic_timeout
    if timeout is None:
        timeout = int(knobs.read("HORA_ELASTIC_TIMEOUT", os.environ))
    cooldown = args.blacklist_cooldown_range
    settings = ElasticSettings(
        num_proc=int(args.num_proc),
        min_num_proc=None if args.min_num_proc is None else int(args.min_num_proc),
        max_num_proc=None if args.max_num_proc is None else int(args.max_num_proc),
        slots_per_host=None if args.slots_per_host is None else int(args.slots_per_host),
        elastic_timeout=int(timeout),
        reset_limit=None if args.reset_limit is None else int(args.reset_limit),
        blacklist_cooldown_range=None if cooldown is None else (int(cooldown[0]), int(cooldown[1])),
        host_discovery_script=args.host_discovery_script,
        hosts=args.hosts,
        hostfile=args.hostfile,
    )
    settings.validate()
    if not settings.elastic:
        return None
    if args.controller == "mpi":
        raise ValueError("--mpi cannot run an elastic job: MPI's world is fixed; drop --mpi or the elastic flags")
    return settings


def _refuse_unsupported(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.controller == "jsrun":
        parser.error("--jsrun: IBM jsrun is not supported: use -H/--hostfile (ssh) or start the ranks with mpirun")
    for dest in ("mpi_args", "binding_args"):
        if getattr(args, dest) is not None and args.controller != "mpi":
            flag = "--" + dest.replace("_", "-")
            parser.error(f"{flag} applies to --mpi only: add --mpi or drop {flag}")


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
