"""Argument parsing shared by moe_rt's command line (``python -m moe_rt demo|bench``) and the benchmarks."""
from __future__ import annotations

import argparse
import re


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, each option's default after its help (not for defaults of None or False:
    flags, and sizes whose default the help explains)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v

    parse.__doc__ = f"argparse type: an int >= {low}."
    return parse


positive_int = _int_at_least(1)
nonnegative_int = _int_at_least(0)


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated ints >= 1 (e.g. ``4096,16384``)."""
    out = [positive_int(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return out


def plain_text(doc: str) -> str:
    """A docstring as help text: reST roles and inline literals as plain words (``:func:`x``` -> ``x``),
    the first letter upper case."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc).strip()
    return doc[:1].upper() + doc[1:]
