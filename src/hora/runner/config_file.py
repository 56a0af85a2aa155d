"""``horarun --config-file FILE``: horovodrun's YAML configuration, read the same way.

The file has horovodrun's sections; a value given on the command line wins over the
file's::

    controller: gloo            # gloo (hora's built-in transport) or mpi
    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 10
      cache_capacity: 2048
      hierarchical_allreduce: true
      hierarchical_allgather: true
    autotune:
      enabled: true
      log_file: autotune.csv
      warmup_samples: 5
      steps_per_sample: 20
      bayes_opt_max_samples: 50
      gaussian_process_noise: 0.9
    timeline:
      filename: timeline.json
      mark_cycles: true
    stall_check:
      enabled: true
      warning_time_seconds: 120
      shutdown_time_seconds: 240
    library_options:
      mpi_threads_disable: true
      num_nccl_streams: 2
      gloo_timeout_seconds: 60
    logging:
      level: INFO
      hide_timestamp: true

Each key sets the knob that declares it (``hora.config.knobs``: ``Knob.yaml``), as the
knob's flag would. An unknown section or key, or a value of the wrong type, is an error that
names the file, the key and what is accepted.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hora.config import knobs



# horovodrun's sections, in its order.
SECTIONS = ("params", "autotune", "timeline", "stall_check", "library_options", "logging")


def _keys() -> dict[str, dict[str, knobs.Knob]]:
    """section -> key -> the knob it sets, from the knobs' ``yaml`` declarations."""
    keys: dict[str, dict[str, knobs.Knob]] = {section: {} for section in SECTIONS}
    for knob in knobs.KNOBS:
        if knob.yaml is not None:
            section, key = knob.yaml.split(".")
            keys[section][key] = knob  # KeyError: a section horovodrun lacks
    return keys


KEYS = _keys()
CONTROLLERS = ("gloo", "mpi")


def _typed(value: Any, kind: type, where: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: {value!r} is not valid: expected true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where}: {value!r} is not valid: expected an integer")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where}: {value!r} is not valid: expected a number")
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: {value!r} is not valid: expected a string")


def load(path: str) -> Mapping[str, Any]:
    """Reads the YAML file.

    Raises:
        ValueError: it cannot be read or parsed, or is not a mapping; names the file.
    """
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ValueError(f"--config-file: cannot read {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else "not valid YAML"
        raise ValueError(f"--config-file {path}: not valid YAML: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of sections (params, autotune, ...)")
    return data


def apply(args: argparse.Namespace, path: str, given: set[str]) -> None:
    """Sets ``args`` from the file for every destination not in ``given`` (the command line's).

    Raises:
        ValueError: an unknown section or key, or a value of the wrong type.
    """
    data = load(path)
    for section, values in data.items():
        if section == "controller":
            if values not in CONTROLLERS:
                raise ValueError(f"--config-file {path}: controller: {values!r} is not valid: expected gloo or mpi")
            if "controller" not in given:
                args.controller = values
            continue
        keys = KEYS.get(str(section))
        if keys is None:
            raise ValueError(
                f"--config-file {path}: unknown section {section!r}: expected controller, {', '.join(KEYS)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"--config-file {path}: section {section!r} must be a mapping of keys to values")
        for key, value in values.items():
            if key not in keys:
                raise ValueError(
                    f"--config-file {path}: unknown key {section}.{key}: expected one of {', '.join(keys)}"
                )
            knob = keys[key]
            if knob.dest not in given:
                setattr(args, knob.dest, _value(knob, value, f"--config-file {path}: {section}.{key}"))


def _value(knob: knobs.Knob, value: Any, where: str) -> Any:
    """The knob's value for a key's: typed as the knob's flag takes it, checked, in the knob's units."""
    option = next((option for option in knob.options if option.metavar is not None), None)
    if option is None:  # flags without a value: the key is true or false
        typed = _typed(value, bool, where)
        return not typed if knob.yaml_invert else typed
    kind = option.kind or knob.kind
    typed = _typed(value, kind.yaml_type, where)
    try:
        return knob.from_option(option, kind.check(typed))
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not valid: expected {kind.accepted}") from None
