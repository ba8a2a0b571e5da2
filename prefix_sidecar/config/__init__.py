"""The sidecar's configuration: one YAML file, overridden by PREFIX_SIDECAR_* env vars, then flags.

`Config` is one table of fields (prefix_sidecar/fields.py), declared by subsystem: listen.py,
membership.py, routing.py, startup.py, upstream.py and operations.py, joined in table.py.
Each field's default, help, flag and check are declared once, and the file, env vars, flags,
`--print-config`, the docs table and the components' own defaults all read it (loading.py).
Every field is validated at start; a bad value fails with the field's name and the reason,
so a broken ConfigMap is caught by the pod's first start, not by the first request.

A tuning constant that only a benchmark can tune is not a field: it is a named constant of
the module that uses it, with the measurement that chose it; removed.py lists the fields that
became one, so a config that still sets one fails naming where it went.
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
