"""The sidecar's configuration: one YAML file, overridden by PREFIX_SIDECAR_* env vars, then flags.

`Config` is one table of fields (prefix_sidecar/fields.py), declared per subsystem module and
joined in table.py; the file, env, flags, `--print-config`, the docs table and components'
defaults all read it (loading.py). Every field is validated at start, naming the field, so a
broken ConfigMap fails the pod's first start, not its first request. A constant only a
benchmark can tune is not a field; removed.py says where each removed field went.
"""

from prefix_sidecar.config.checks import ConfigError
from prefix_sidecar.config.listen import DEFAULT_SOCKET
from prefix_sidecar.config.loading import add_arguments, build_config, describe, from_args
from prefix_sidecar.config.removed import REMOVED_FIELDS
from prefix_sidecar.config.startup import PrefixSpec
from prefix_sidecar.config.table import DEFAULTS, FIELDS, Config
from prefix_sidecar.config.upstream import API_KEY_ENV

__all__ = [
    "API_KEY_ENV",
    "DEFAULTS",
    "DEFAULT_SOCKET",
    "FIELDS",
    "REMOVED_FIELDS",
    "Config",
    "ConfigError",
    "PrefixSpec",
    "add_arguments",
    "build_config",
    "describe",
    "from_args",
]
