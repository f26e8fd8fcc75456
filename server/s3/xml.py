"""S3 XML: a tiny writer for responses and a safe reader (no entity expansion) for request bodies."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Union
from xml.etree.ElementTree import Element

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from .errors import S3Error

S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"

# A node is (tag, text) or (tag, [children]); None values are skipped.
Node = tuple[str, Union[str, int, bool, None, Iterable["Node"]]]

_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&apos;"})


def escape(text: str) -> str:
    return text.translate(_ESCAPES)


def _render(node: Node, out: list[str]) -> None:
    tag, value = node
    if value is None:
        return
    if isinstance(value, bool):
        out.append(f"<{tag}>{'true' if value else 'false'}</{tag}>")
    elif isinstance(value, (str, int)):
        out.append(f"<{tag}>{escape(str(value))}</{tag}>")
    else:
        out.append(f"<{tag}>")
        for child in value:
            _render(child, out)
        out.append(f"</{tag}>")


def document(root: str, children: Iterable[Node], *, namespace: bool = True) -> bytes:
    """Serialize a response document with the XML declaration and the S3 namespace."""
    out = ['<?xml version="1.0" encoding="UTF-8"?>\n', f'<{root} xmlns="{S3_NS}">' if namespace else f"<{root}>"]
    for child in children:
        _render(child, out)
    out.append(f"</{root}>")
    return "".join(out).encode("utf-8")


def iso8601(ts: float) -> str:
    """Timestamps in listings: 2026-11-30T14:23:22.000Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


def parse(body: bytes) -> Element:
    """Parse a request body safely; namespaces are stripped from tags. Malformed → MalformedXML."""
    try:
        root = SafeET.fromstring(body, forbid_dtd=True)
    except (SafeET.ParseError, DefusedXmlException, ValueError, LookupError):  # LookupError: an unknown encoding
        raise S3Error("MalformedXML") from None
    for element in root.iter():
        if isinstance(element.tag, str) and "}" in element.tag:
            element.tag = element.tag.split("}", 1)[1]
    return root


def child_text(element: Element, tag: str) -> str | None:
    found = element.find(tag)
    return None if found is None else (found.text or "")
