"""Where the client's key pair comes from: the arguments, else one pair of environment variables.

``CTXSTORE_ACCESS_KEY`` / ``CTXSTORE_SECRET_KEY`` first, then ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
(what ``ctxstore serve`` prints, and what S3 tools read). The variables of a pair are taken together: a pair
with only one of them set is an error, never completed from the other pair, so a key and a secret of two
different tenants cannot be combined.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigurationError

#: (access key variable, secret key variable), in the order they are looked at.
ENV_PAIRS = (("CTXSTORE_ACCESS_KEY", "CTXSTORE_SECRET_KEY"), ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))


def resolve_credentials(access_key: str | None, secret_key: str | None, *,
                        environ: Mapping[str, str] | None = None,
                        how: str = "pass access_key= and secret_key=") -> tuple[str, str]:
    """(access key, secret key): the arguments; what they leave out comes from the first pair of
    :data:`ENV_PAIRS` with a variable set. ConfigurationError when something is missing; ``how`` says how to
    pass them in the caller's words (a command names its flags)."""
    if access_key and secret_key:
        return access_key, secret_key
    env = os.environ if environ is None else environ
    for access_var, secret_var in ENV_PAIRS:
        access_env, secret_env = env.get(access_var, ""), env.get(secret_var, "")
        if not (access_env or secret_env):
            continue
        access, secret = access_key or access_env, secret_key or secret_env
        if not (access and secret):
            present, missing = (secret_var, access_var) if not access else (access_var, secret_var)
            raise ConfigurationError(f"{present} is set but {missing} is not: set both (a key pair is never "
                                     "made of two sources)")
        return access, secret
    raise ConfigurationError(f"no credentials: {how}, or set CTXSTORE_ACCESS_KEY and CTXSTORE_SECRET_KEY (or "
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, as `ctxstore serve` prints them)")
