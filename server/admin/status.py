"""The status page (admin/status.html): one self-contained page, served without the token because it holds no
data and no secret; every API call it makes carries the token the operator gives it (URL fragment ``#token=``
or its token field). The CSP admits only its own inline scripts and style and calls to this origin."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from pathlib import Path

PAGE = Path(__file__).with_name("status.html")


@lru_cache(maxsize=1)
def page_and_headers() -> tuple[bytes, dict[str, str]]:
    """The page and its response headers; OSError if the page is not installed."""
    page = PAGE.read_bytes()
    scripts = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(m).digest()).decode()}'"
                       for m in re.findall(rb"<script>(.*?)</script>", page, re.S))
    csp = (f"default-src 'none'; script-src {scripts}; style-src 'unsafe-inline'; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page, {"Cache-Control": "no-store", "Content-Security-Policy": csp, "Referrer-Policy": "no-referrer",
                  "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}
