#!/usr/bin/env python3
"""Write a ctxstore env file with fresh random credentials from deploy/ctxstore.env.example.

    python3 deploy/make_env.py deploy/ctxstore.env          # for deploy/compose.yaml
    python3 deploy/make_env.py /etc/ctxstore/secrets.env    # anywhere else ('-' prints to stdout)

Every ``<REPLACE-ME...>`` value of the example gets a random one: an AWS-style access key (20 uppercase
letters and digits), a 40-character secret key, a 43-character admin token. The file is created with mode
0600 and an existing file is never overwritten (``--force`` does). Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import string
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "ctxstore.env.example"
PLACEHOLDER = re.compile(r"^(?P<name>[A-Z0-9_]+)=<REPLACE-ME[^>]*>\s*$")


def random_value(name: str) -> str:
    if name.endswith("ACCESS_KEY"):
        alphabet = string.ascii_uppercase + string.digits
        return "CTX" + "".join(secrets.choice(alphabet) for _ in range(17))
    if name.endswith("SECRET_KEY"):
        return secrets.token_urlsafe(30)  # 40 characters
    return secrets.token_urlsafe(32)  # 43 characters


def render(example: str) -> str:
    out = []
    for line in example.splitlines():
        match = PLACEHOLDER.match(line)
        out.append(f"{match['name']}={random_value(match['name'])}" if match else line)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="file to write ('-' for stdout)")
    parser.add_argument("--example", type=Path, default=EXAMPLE, help=f"template (default {EXAMPLE})")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = parser.parse_args(argv)
    text = render(args.example.read_text())
    if args.dest == "-":
        sys.stdout.write(text)
        return 0
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.force else os.O_EXCL)
    try:
        fd = os.open(args.dest, flags, 0o600)
    except FileExistsError:
        parser.error(f"{args.dest} exists (--force overwrites it)")
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(args.dest, 0o600)
    print(f"wrote {args.dest} (mode 0600)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
