"""Every knob is declared once (hora.config.knobs) and everything else agrees with the declaration:
the Config reader, horarun's flags, the config file's keys, the docs' tables, the package's sources."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from hora.config import Config, Extras, knobs
from hora.runner.cli import parse_settings

ROOT = Path(__file__).resolve().parent.parent
FIELD_KNOBS = [knob for knob in knobs.KNOBS if knob.field is not None]


def sample(knob: knobs.Knob) -> Any:
    """A valid value of the knob other than its default."""
    kind = knob.kind
    if isinstance(kind, knobs.Integer):
        return kind.lo + 1
    if isinstance(kind, knobs.Number):
        return (kind.lo + kind.hi) / 2 if kind.hi is not None else kind.lo + 1.5
    if isinstance(kind, knobs.Boolean):
        return not knob.default
    if isinstance(kind, knobs.Choice):
        return next(choice for choice in kind.choices if choice != knob.default)
    if isinstance(kind, knobs.Cores):
        return (1, 0)
    return "somewhere"


def field_of(config: Config, knob: knobs.Knob) -> Any:
    assert knob.field is not None
    holder: Any = config.extras if knob.field.startswith("extras.") else config
    return getattr(holder, knob.field.removeprefix("extras."))


def test_the_docs_tables_are_the_declarations() -> None:
    document = (ROOT / "docs" / "configuration.md").read_text()
    assert knobs.render(document) == document, "run: python -m hora.config docs/configuration.md"
    for section in knobs.SECTIONS:
        assert f"<!-- knobs: {section} -->" in document


def test_config_defaults_are_the_declared_defaults() -> None:
    config = Config.from_env({})
    assert Config() == dataclasses.replace(config, topology=Config().topology)
    for knob in FIELD_KNOBS:
        declared = None if knob.default is None else knob.default * knob.field_unit
        assert field_of(config, knob) == declared, knob.name
    assert Extras().unsupported() == []


@pytest.mark.parametrize("knob", FIELD_KNOBS, ids=lambda knob: knob.name)
def test_every_field_knob_is_read_under_each_of_its_names(knob: knobs.Knob) -> None:
    value = sample(knob)
    expected = value * knob.field_unit
    for name in (knob.name, *knob.aliases):
        assert field_of(Config.from_env({name: knob.kind.write(value)}), knob) == expected, name
    if knob.aliases:  # the hora name wins over Horovod's
        both = {knob.aliases[0]: knob.kind.write(value), knob.name: knob.kind.write(knob.default or value)}
        assert field_of(Config.from_env(both), knob) == (knob.default or value) * knob.field_unit


@pytest.mark.parametrize("knob", [knob for knob in knobs.KNOBS if knob.options], ids=lambda knob: knob.name)
def test_every_flag_sets_its_variable(knob: knobs.Knob) -> None:
    for option in knob.options:
        if option.metavar is None:
            args, expected = [option.names[-1]], option.const
        else:
            value = sample(knob)
            given = value / option.scale if option.scale != 1 else value
            text = ",".join(map(str, given)) if isinstance(given, tuple) else str(given)
            args, expected = [option.names[0], text], value
        settings = parse_settings(["-np", "2", *args, "true"])
        assert settings is not None
        if knob.name == "HORA_START_TIMEOUT":  # the launcher's own setting, passed on by rank_env
            assert settings.start_timeout == expected
            continue
        assert settings.tuning.env() == {knob.name: knob.kind.write(expected)}, args


@pytest.mark.parametrize("knob", [knob for knob in knobs.KNOBS if knob.yaml], ids=lambda knob: knob.name)
def test_every_config_file_key_sets_its_variable(knob: knobs.Knob, tmp_path: Path) -> None:
    assert knob.yaml is not None
    section, key = knob.yaml.split(".")
    value = sample(knob)
    option = next((option for option in knob.options if option.metavar is not None), None)
    if option is None:
        written: Any = (not value) if knob.yaml_invert else bool(value)
    elif isinstance(value, tuple):
        written = ",".join(map(str, value))
    else:
        written = value / option.scale if option.scale != 1 else value
    path = tmp_path / "hora.yaml"
    path.write_text(f"{section}:\n  {key}: {written!r}\n".replace("'", '"'))
    settings = parse_settings(["-np", "2", "--config-file", str(path), "true"])
    assert settings is not None
    if knob.name == "HORA_START_TIMEOUT":
        assert settings.start_timeout == value
    else:
        assert settings.tuning.env() == {knob.name: knob.kind.write(value)}


def test_two_flags_of_one_knob_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["-np", "2", "--cache-capacity", "5", "--disable-cache", "true"])
    assert "not allowed with argument --cache-capacity" in capsys.readouterr().err


def test_the_package_reads_hora_and_horovod_variables_only_through_the_knobs() -> None:
    declared = set(knobs.names())
    direct = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*f?[\"'](?:HORA|HOROVOD)_")
    for path in sorted((ROOT / "src" / "hora").rglob("*.py")):
        source = path.read_text()
        for name in re.findall(r"[\"']((?:HORA|HOROVOD)_[A-Z0-9_]+)[\"']", source):
            assert name in declared, f"{path.relative_to(ROOT)} names {name}, which no knob declares"
        code = "\n".join(line for line in source.splitlines() if ">>>" not in line)  # not docstring examples
        assert not direct.search(code), f"{path.relative_to(ROOT)} reads a variable without hora.config.knobs"
