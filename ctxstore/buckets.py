"""S3's rules for bucket names, as one table: the client checks a name before any request, and a node checks
the same table in its CreateBucket handler, so the two can never disagree.

A name that breaks a rule would otherwise go into a request path where it means something else: ``kv-a/llama3``
becomes object ``llama3`` of bucket ``kv-a``, ``kv-a?x=1`` a query string. Each row is (what the rule says,
test of a name); the first row a name fails is the one reported.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from urllib.parse import quote

from .errors import ConfigurationError

_CHARACTERS = re.compile(r"[a-z0-9.\-]*")
_IP_ADDRESS = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+")
RESERVED_PREFIXES = ("xn--", "sthree-")
RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3")

RULES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("is 3 to 63 characters long", lambda name: 3 <= len(name) <= 63),
    ("has only lowercase letters, digits, hyphens and dots", lambda name: bool(_CHARACTERS.fullmatch(name))),
    ("begins and ends with a letter or a digit", lambda name: name[0] not in ".-" and name[-1] not in ".-"),
    ("has no two dots in a row", lambda name: ".." not in name),
    ("has no dot next to a hyphen", lambda name: ".-" not in name and "-." not in name),
    ("is not an IP address", lambda name: not _IP_ADDRESS.fullmatch(name)),
    (f"does not begin with {' or '.join(RESERVED_PREFIXES)}", lambda name: not name.startswith(RESERVED_PREFIXES)),
    (f"does not end with {', '.join(RESERVED_SUFFIXES)}", lambda name: not name.endswith(RESERVED_SUFFIXES)),
)


def broken_rule(name: str) -> str | None:
    """The first rule of :data:`RULES` that ``name`` breaks, or None for a valid bucket name."""
    for rule, holds in RULES:
        if not holds(name):
            return rule
    return None


def valid_bucket_name(name: str) -> bool:
    return broken_rule(name) is None


def check_bucket(name: str) -> str:
    """``name`` if it is a valid bucket name, else ConfigurationError naming the rule it breaks."""
    if not isinstance(name, str):
        raise ConfigurationError(f"a bucket name is a str, not {type(name).__name__}")
    return _checked(name)


@functools.lru_cache(maxsize=1024)  # a worker uses a few names over and over: each is checked once
def _checked(name: str) -> str:
    rule = broken_rule(name)
    if rule is not None:
        raise ConfigurationError(f"bad bucket name {name!r}: an S3 bucket name {rule}")
    return name


def path_segment(text: str) -> str:
    """``text`` percent-encoded for one segment of a request path (``/`` included): what is sent is also what
    SigV4 signs, since the signer leaves an encoded path as it is."""
    return quote(text, safe="-_.~")
