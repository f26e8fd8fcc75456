"""The ``ctxstore admin`` argument parser and entry point."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..cliargs import ArgumentParser
from .commands import (
    Context,
    cmd_buckets,
    cmd_flush,
    cmd_health,
    cmd_settings_get,
    cmd_settings_set,
    cmd_stats,
    cmd_tenants_create,
    cmd_tenants_list,
    cmd_tenants_revoke,
    cmd_top,
)
from .common import DEFAULT_NODES, DEFAULT_TIMEOUT, ENV_NODES, ENV_TOKEN, EXIT_OK, EXIT_USAGE, UsageError
from .nodes import Pod, parse_nodes

# ---------------------------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    # The common options are accepted before or after the subcommand (`ctxstore admin stats --json`).
    common = ArgumentParser(add_help=False)
    common.add_argument("--nodes", default=argparse.SUPPRESS,
                        help=f"comma-separated host:port or http(s)://host:port of the pod's nodes "
                             f"[env {ENV_NODES}; default {DEFAULT_NODES}]")
    common.add_argument("--token", default=argparse.SUPPRESS,
                        help=f"admin bearer token [env {ENV_TOKEN}, preferred: arguments show in ps]")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one machine-readable JSON document (top: one per line)")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                        help=f"seconds per call and node [default {DEFAULT_TIMEOUT:g}]")
    common.add_argument("--strict", action="store_true", default=argparse.SUPPRESS,
                        help="exit 1 when any node failed (default: only when all did)")
    common.add_argument("--insecure", action="store_true", default=argparse.SUPPRESS,
                        help="do not verify HTTPS certificates")

    parser = ArgumentParser(
        prog="ctxstore admin", parents=[common],
        description="Administer a ctxstore node or a whole pod through the admin API.",
        epilog="exit codes: 0 at least one node answered (with --strict: all did); 1 no node answered or "
               "none could do it; 2 usage error (bad arguments, no token). See docs/operations.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("stats", parents=[common], help="totals of the pod and one row per node")
    p.add_argument("--reset", action="store_true", help="zero the counters after reading them")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("buckets", parents=[common], help="buckets summed over the nodes")
    p.add_argument("--per-node", action="store_true", help="one row per node under each bucket")
    p.set_defaults(func=cmd_buckets)

    tenants = sub.add_parser("tenants", parents=[common], help="tenant keys: create, list, revoke")
    tsub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION")
    tsub.required = True
    p = tsub.add_parser("create", parents=[common], help="one key pair for NAME, created on every node")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--quota", metavar="SIZE", help="byte quota of the tenant on each node, e.g. 2GiB")
    p.set_defaults(func=cmd_tenants_create)
    p = tsub.add_parser("list", parents=[common], help="every key, merged over the nodes")
    p.set_defaults(func=cmd_tenants_list)
    p = tsub.add_parser("revoke", parents=[common], help="disable a key on every node")
    p.add_argument("access_key", metavar="ACCESS_KEY")
    p.add_argument("--delete", action="store_true", help="delete the key instead of disabling it")
    p.set_defaults(func=cmd_tenants_revoke)

    p = sub.add_parser("flush", parents=[common], help="delete (or expire) a bucket's objects on every node")
    p.add_argument("bucket", metavar="BUCKET")
    p.add_argument("--prefix", default="", help="only keys under this prefix")
    p.add_argument("--expire", action="store_true", help="expire the objects instead of deleting them")
    p.set_defaults(func=cmd_flush)

    settings = sub.add_parser("settings", parents=[common], help="runtime settings: get, set")
    ssub = settings.add_subparsers(dest="settings_command", metavar="ACTION")
    ssub.required = True
    p = ssub.add_parser("get", parents=[common], help="memory budget and TTLs of every node")
    p.set_defaults(func=cmd_settings_get)
    p = ssub.add_parser("set", parents=[common], help="e.g. memory=4GiB default_ttl=10m max_ttl=1d")
    p.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    p.set_defaults(func=cmd_settings_set)

    p = sub.add_parser("health", parents=[common], help="live/ready of every node (no token needed)")
    p.set_defaults(func=cmd_health, needs_token=False)

    p = sub.add_parser("top", parents=[common], help="live view per node: RAM and flash tiers, hit ratio, rates")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes [default 2]")
    p.add_argument("--iterations", type=int, default=None, metavar="N", help="stop after N refreshes")
    p.set_defaults(func=cmd_top)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        given = getattr(args, "nodes", None) or os.environ.get(ENV_NODES)
        nodes = parse_nodes(given or DEFAULT_NODES)
        if not given and not _listening(DEFAULT_NODES):
            # The default is the README's local node; without it, "down" would hide that no nodes were given.
            raise UsageError(f"no nodes given: pass --nodes host:port,... or set {ENV_NODES} (nothing listens at "
                             f"{DEFAULT_NODES}, the default)")
        token = getattr(args, "token", None) or os.environ.get(ENV_TOKEN, "")
        token = token.strip()
        if getattr(args, "needs_token", True) and not token:
            raise UsageError(f"no admin token: set {ENV_TOKEN} (a node started without one prints the token "
                             "it generated) or pass --token")
        timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
        if not timeout > 0:
            raise UsageError("--timeout must be positive")
        pod = Pod(nodes, token=token, timeout=timeout, insecure=getattr(args, "insecure", False))
        ctx = Context(pod=pod, json=getattr(args, "json", False), strict=getattr(args, "strict", False),
                      args=args)
        code: int = args.func(ctx)
        return code
    except UsageError as exc:
        print(f"ctxstore admin: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ctxstore admin ... | head`
        return EXIT_OK


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
