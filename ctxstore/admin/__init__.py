"""``ctxstore admin``: the admin API of one node or of a whole pod, from the command line.

Every command talks to each node of the pod in parallel (stdlib ``urllib``, short timeouts), aggregates
what the nodes answered, and prints rich tables, or with ``--json`` one machine-readable document with
stable keys. A node that is down never hides the others: it is marked down with its error.

Exit codes (also in docs/operations.md):

- ``0``: at least one node answered (nodes that did not are marked in the output); with ``--strict``,
  every node answered.
- ``1``: no node answered, or none could do what was asked (e.g. revoking a key no node knows);
  with ``--strict``, any node failed.
- ``2``: usage error: bad arguments, no admin token, no nodes.

The admin token comes from ``--token`` or ``CTXSTORE_ADMIN_TOKEN`` (prefer the variable: arguments show in
``ps``); the nodes from ``--nodes a:9000,b:9000`` or ``CTXSTORE_NODES`` (default ``127.0.0.1:9000``).
``rich`` (the ``cli`` extra, also installed as ``admin``) is needed for tables, not for ``--json``.
"""

from ..units import parse_duration, parse_size
from .aggregate import Sample, interval_hit_ratio, node_stats, rates_between
from .cli import main
from ..admin_schema import STAT_KEYS
from .common import ENV_NODES, ENV_TOKEN, EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from .nodes import node_name, parse_nodes

__all__ = [
    "ENV_NODES",
    "ENV_TOKEN",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "STAT_KEYS",
    "Sample",
    "UsageError",
    "interval_hit_ratio",
    "main",
    "node_name",
    "node_stats",
    "parse_duration",
    "parse_nodes",
    "parse_size",
    "rates_between",
]
