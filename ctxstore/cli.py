"""The ``ctxstore`` command. ``ctxstore serve`` runs a node (needs the ``server`` extra); ``ctxstore admin``
administers a node or a whole pod through the admin API; ``ctxstore bench`` loads a running pod and measures it
(tables and progress need the ``cli`` extra: rich)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ctxstore serve [options]   (ctxstore serve --help lists them)\n"
              "       ctxstore admin COMMAND ...  (stats, buckets, tenants, flush, settings, health, top;\n"
              "                                    ctxstore admin --help)\n"
              "       ctxstore bench --namespace BUCKET [options]  (load a running pod and measure it;\n"
              "                                    ctxstore bench --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        try:
            # mypy checks the server as the folder server/, not under its installed name
            from ctxstore_server.serve import main as serve  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            print(f"ctxstore serve needs the server extra: pip install '/path/to/ctxstore[server]' from a checkout "
                  f"({exc})", file=sys.stderr)
            return 2
        code: int = serve(rest)
        return code
    if command == "admin":
        from ctxstore.admin import main as admin

        return admin(rest)
    if command == "bench":
        from ctxstore.bench import main as bench

        return bench(rest)
    print(f"ctxstore: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
