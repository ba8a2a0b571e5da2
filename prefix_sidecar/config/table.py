"""`Config`: every setting of a sidecar, one frozen dataclass made of the subsystems' groups.

Each group (listen, membership, pools, routing, startup, upstream, operations) declares its fields
with `setting()` in its own module; `Config` inherits them all, so a component reads one
flat `config.field` and the table (`FIELDS`, in this order: docs/api.md's configuration
table) is every group's fields.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from prefix_sidecar import fields
from prefix_sidecar.config.checks import ConfigError
from prefix_sidecar.config.listen import ListenSettings, check_listeners
from prefix_sidecar.config.membership import MembershipSettings
from prefix_sidecar.config.operations import OperationsSettings
from prefix_sidecar.config.pools import PoolSettings, check_pools, pool_configs
from prefix_sidecar.config.routing import RoutingSettings
from prefix_sidecar.config.startup import StartupSettings, check_prefixes
from prefix_sidecar.config.upstream import UpstreamSettings


# A dataclass lists its bases' fields from the last base to the first: this order puts the
# listeners first and the operations last.
@dataclass(frozen=True)
class Config(
    OperationsSettings,
    UpstreamSettings,
    StartupSettings,
    RoutingSettings,
    PoolSettings,
    MembershipSettings,
    ListenSettings,
):
    """Every setting of a sidecar; see docs/api.md's configuration table (made from this)."""


DEFAULTS = Config()  # the defaults components take when built without a Config
FIELDS = fields.table(Config)


def _in_pool(name: str) -> Callable[[str, str], str]:
    """The error message of a bad value a pool sets, naming the pool and the field."""
    return lambda field, reason: f"config field 'pools' ({name}): {field!r} {reason}"


def validate(config: Config) -> Config:
    """Every field's own check, then the rules across fields; the first failure raises
    ConfigError naming its field."""
    fields.validate(config, lambda name, reason: f"config field {name!r} {reason}")
    check_listeners(config)
    check_prefixes(config)
    check_pools(config)
    for pool, pool_config in pool_configs(config) if config.pools else ():
        fields.validate(pool_config, _in_pool(pool.name))
        check_prefixes(pool_config)
    if config.tokenizer_file:
        _check_tokenizer(config)
    if config.unregistered_routing == "precise" and not (config.kv_events or config.kv_index_url):
        raise ConfigError(
            "config field 'unregistered_routing' is precise, which reads the pods' KV "
            "events: set kv_events=true, or kv_index_url to a kv-indexer's Redis"
        )
    return config


def _check_tokenizer(config: Config) -> None:
    if config.unregistered_routing != "precise":
        raise ConfigError(
            "config field 'tokenizer_file' is read by precise routing only: set "
            "unregistered_routing=precise, or leave it empty"
        )
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigError(
            "config field 'tokenizer_file' needs the tokenizers package: "
            "pip install 'prefix-sidecar[tokenizer]'"
        )
