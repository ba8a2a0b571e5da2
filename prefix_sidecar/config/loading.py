"""Where a Config comes from: one YAML file, overridden by PREFIX_SIDECAR_* env vars, then
flags (`--listen`, ..., `--set FIELD=VALUE`); and how it is shown (`serve --print-config`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from prefix_sidecar import fields
from prefix_sidecar.config.checks import ConfigError
from prefix_sidecar.config.removed import REMOVED_FIELDS
from prefix_sidecar.config.table import FIELDS, Config, validate

ENV_PREFIX = "PREFIX_SIDECAR_"


def build_config(
    file_values: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file < env < overrides (flags) into a validated Config."""
    values: dict[str, Any] = {}
    _merge(values, file_values or {}, "config file")
    for key, raw in (env or {}).items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        _refuse_removed(name, f"env var {key}")
        if name in FIELDS:  # other PREFIX_SIDECAR_* vars (the API key) are not fields
            values[name] = fields.coerce(FIELDS[name], raw)
    _merge(values, overrides or {}, "flags")
    return validate(Config(**values))


def _merge(values: dict[str, Any], source: Mapping[str, Any], source_name: str) -> None:
    for name, raw in source.items():
        _refuse_removed(name, f"the {source_name}")
        if name not in FIELDS:
            raise ConfigError(
                f"unknown config field {name!r} in the {source_name}; "
                f"known fields: {', '.join(sorted(FIELDS))}"
            )
        values[name] = fields.coerce(FIELDS[name], raw)


def _refuse_removed(name: str, where: str) -> None:
    now = REMOVED_FIELDS.get(name)
    if now is not None:
        raise ConfigError(
            f"config field {name!r} (in {where}) was removed from the config: it is now {now}"
        )


def load_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of fields, got {type(data).__name__}"
        )
    if isinstance(data.get("socket_mode"), int):
        # YAML reads `socket_mode: 440` as decimal 440 (0o670) but `0660` as octal: take
        # the digits as written, so every spelling of a mode means what a chmod user expects.
        data["socket_mode"] = _raw_scalar(text, "socket_mode")
    return data


def _raw_scalar(text: str, key: str) -> str:
    root = yaml.compose(text)
    for key_node, value_node in getattr(root, "value", ()):
        if getattr(key_node, "value", None) == key and isinstance(value_node, yaml.ScalarNode):
            return str(value_node.value)
    raise ConfigError(f"config field {key!r}: cannot read its value")  # pragma: no cover


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for `serve`, from the table; every field can also be set in the file or the env."""
    parser.add_argument("--config", help="YAML config file")
    fields.add_flags(parser, Config, typed=False)
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other config field, e.g. --set load_factor=1.5 (repeatable)",
    )


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    file_values = load_file(args.config) if args.config else {}
    overrides = fields.given(args, Config)
    for setting_text in args.settings:
        name, sep, value = setting_text.partition("=")
        if not sep:
            raise ConfigError(f"--set {setting_text!r} must look like FIELD=VALUE")
        name = name.strip()
        if name == "socket_mode":  # octal text, as chmod reads it
            overrides[name] = value
        else:
            overrides[name] = yaml.safe_load(value) if value else ""
    return build_config(file_values, os.environ if env is None else env, overrides)


def describe(config: Config) -> dict[str, Any]:
    """The config as plain data, for logs and `serve --print-config`; no secrets in it."""
    data = dataclasses.asdict(config)
    data["socket_mode"] = oct(config.socket_mode)
    data["pools"] = [pool.describe() for pool in config.pools]
    return data
