"""The argument parser of every ``ctxstore`` command: a mistake is said first, in one line, with the flag that
was probably meant, instead of after argparse's usage block (dozens of lines for ``ctxstore serve``)."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        lines = [f"{self.prog}: error: {message}"]
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
            for word in unknown.group(1).split():
                close = difflib.get_close_matches(word.partition("=")[0], flags, n=1) if word.startswith("-") else []
                if close:
                    lines.append(f"  did you mean {close[0]}?")
        lines.append(f"  ({self.prog} --help lists the options)")
        self.exit(2, "\n".join(lines) + "\n")
