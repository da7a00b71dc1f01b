"""Build argparse flags from config dataclasses, so every default lives in its dataclass only."""

from __future__ import annotations

import argparse
import dataclasses
import typing


def add_config_flags(parser: argparse.ArgumentParser, cls, helps: dict[str, str], rename: dict[str, str] | None = None):
    """One --flag per field named in `helps` (flag = field with '-' or rename[field]); default from the dataclass."""
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, text in helps.items():
        flag = "--" + (rename or {}).get(name, name.replace("_", "-"))
        default, hint = defaults[name], hints[name]
        if hint is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=default, help=text)
            continue
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        parser.add_argument(flag, dest=name, type=base, default=default, help=f"{text} (default: {default})")


def config_from_args(cls, args: argparse.Namespace, **overrides):
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(args, n) for n in names if hasattr(args, n)}
    values.update(overrides)
    return cls(**values)
