"""``horarun``: the command line, with ``horovodrun``'s flag spellings.

``horarun -np 4 python train.py`` runs ``python train.py`` as ranks 0-3 on this
machine; ``-H host1:2,host2:2`` or ``--hostfile FILE`` says where the ranks run
(``localhost:<np>`` by default). The tuning flags become the ``HORA_*`` variables
``hora.config`` reads (see ``hora.runner.settings``). A bad flag value prints one
line naming the flag and the value and exits with code 2; for the other exit codes
see ``hora.runner.launch``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from hora import config
from hora.runner.launch import launch
from hora.runner.settings import LaunchSettings, Tuning
from hora.version import __version__

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``horarun: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type[int] | type[float], low: float, strict: bool = False) -> Callable[[str], float]:
    """Makes an argparse type for numbers ``>= low`` (``> low`` when strict)."""
    wanted = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {wanted}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {wanted}")
        return value

    return parse


def _log_level(text: str) -> str:
    if text.upper() not in config.LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected one of {', '.join(config.LOG_LEVELS)}")
    return text.upper()


def make_parser() -> argparse.ArgumentParser:
    """Returns the ``horarun`` argument parser."""
    parser = _Parser(
        prog="horarun",
        description="Run a command as the ranks of a hora (Horovod-compatible) job.",
        usage="%(prog)s -np N [options] COMMAND [ARGS...]",
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--version", action="version", version=f"hora {__version__}")
    parser.add_argument("-np", "--num-proc", dest="num_proc", metavar="N", type=_number(int, 1), help="number of ranks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-H", "--hosts", metavar="HOSTS", help="hosts and their slots, e.g. host1:2,host2:4 (default localhost:<np>)"
    )
    where.add_argument("-hostfile", "--hostfile", metavar="FILE", help="file with one 'host slots=N' per line")
    parser.add_argument(
        "--start-timeout",
        metavar="SECONDS",
        type=_number(float, 0, strict=True),
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
    tuning = parser.add_argument_group("tuning (passed to the ranks as HORA_* variables)")
    for flag, metavar, parse, text in (
        ("--fusion-threshold-mb", "MB", _number(float, 0), "fusion buffer size in MiB (0: off)"),
        ("--cycle-time-ms", "MS", _number(float, 0), "ms to gather tensors before negotiating"),
        ("--cache-capacity", "N", _number(int, 0), "response cache entries (0: off)"),
        ("--stall-check-warning-time-seconds", "SECONDS", _number(float, 0, strict=True), "seconds before a warning"),
        ("--stall-check-shutdown-time-seconds", "SECONDS", _number(float, 0), "seconds before shutdown (0: never)"),
        ("--log-level", "LEVEL", _log_level, f"one of {', '.join(config.LOG_LEVELS)}"),
    ):
        tuning.add_argument(flag, metavar=metavar, type=parse, help=text)
    tuning.add_argument("--disable-cache", action="store_true", help="turn the response cache off")
    tuning.add_argument("--no-stall-check", action="store_true", help="turn the stall inspector off")
    tuning.add_argument("--log-without-timestamp", action="store_true", help="leave the time out of hora's log lines")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return parser


def parse_settings(argv: Sequence[str]) -> LaunchSettings:
    """Parses ``horarun``'s arguments.

    Args:
        argv: the arguments, without the program name.

    Returns:
        The launch settings.

    Raises:
        SystemExit: ``--help`` or ``--version`` (code 0), or a bad or missing
            argument (code 2, after one line on stderr).
    """
    parser = make_parser()
    args = parser.parse_args(list(argv))
    if args.num_proc is None:
        parser.error("the following argument is required: -np/--num-proc")
    if not args.command:
        parser.error("no command given: expected horarun -np N COMMAND [ARGS...]")
    return LaunchSettings(
        command=tuple(args.command),
        num_proc=int(args.num_proc),
        hosts=args.hosts,
        hostfile=args.hostfile,
        start_timeout=args.start_timeout,
        verbose=args.verbose,
        output_filename=args.output_filename,
        prefix_timestamp=args.prefix_timestamp,
        tuning=Tuning(
            fusion_threshold_mb=args.fusion_threshold_mb,
            cycle_time_ms=args.cycle_time_ms,
            cache_capacity=None if args.cache_capacity is None else int(args.cache_capacity),
            disable_cache=args.disable_cache,
            no_stall_check=args.no_stall_check,
            stall_check_warning_time_seconds=args.stall_check_warning_time_seconds,
            stall_check_shutdown_time_seconds=args.stall_check_shutdown_time_seconds,
            log_level=args.log_level,
            log_without_timestamp=args.log_without_timestamp,
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``horarun``.

    Args:
        argv: the arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 on success, 2 for a usage error, otherwise as
        ``hora.runner.launch.launch`` returns.
    """
    try:
        settings = parse_settings(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else USAGE_ERROR)
    try:
        return launch(settings)
    except ValueError as exc:
        print(f"horarun: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
