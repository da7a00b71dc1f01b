"""Build argparse flags from config dataclasses, so every default and help text lives in its dataclass only.

A field gets a flag when its metadata has "help". Metadata keys: help; choices; flag (the flag's name when it is not
--field-name); negate (a bool field shown as its opposite, e.g. symmetric -> --asymmetric); store_true (a bool
flag without --no-x). Booleans get --x / --no-x, lists nargs="+". A field whose type is itself a config dataclass
(BenchConfig.spec) contributes its own fields' flags, and config_from_args builds it back; its metadata may hold
"fields": {name: metadata overrides} to give flags to those fields only (a command's share of RuntimeConfig), and
"flat": True to leave its own name out of its fields' dests (BenchConfig.drafters: dests "suffix.x" as generate's,
not "drafters.suffix.x"; the dest is the metavar --help shows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line (the project's bad-input rule) instead of the usage block; exit code 2.
    Subparsers inherit it (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(default=None):
    """argparse type for a float flag: refuses text that is not a number and NaN / infinity, which pass float()
    and then silently poison every comparison a validate() makes (nan < 0 is False)."""
    example = f"e.g. {default}" if default is not None and math.isfinite(default) else "e.g. 0.5"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a finite number ({example})") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite; pass a finite number ({example})")
        return value

    parse.__name__ = "float"
    return parse


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _nested(hint) -> type | None:
    return hint if dataclasses.is_dataclass(hint) else None


def add_config_flags(parser: argparse.ArgumentParser, cls, prefix: str = "", defaults=None,
                     fields: dict[str, dict] | None = None) -> None:
    """One flag per field of cls (and of its nested config dataclasses) that has metadata["help"]; defaults: an
    instance whose values are the flags' defaults (a nested config's default comes from its parent's factory);
    fields: flags for these fields only, each with its metadata updated by the given dict."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, meta, dest = hints[f.name], f.metadata, prefix + f.name
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if _nested(hint):
            add_config_flags(parser, hint, prefix if meta.get("flat") else dest + ".", default, meta.get("fields"))
            continue
        if fields is not None:
            if f.name not in fields:
                continue
            meta = {**meta, **fields[f.name]}
        if "help" not in meta:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if hint is bool and "negate" in meta:
            parser.add_argument(meta["negate"], dest=dest, action="store_false", default=default,
                                help=f"{meta['negate_help']} (default: {'off' if default else 'on'})")
        elif hint is bool and meta.get("store_true"):
            parser.add_argument(flag, dest=dest, action="store_true", default=default, help=meta["help"])
        elif hint is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                                help=meta["help"])
        elif typing.get_origin(hint) is list:
            parser.add_argument(flag, dest=dest, nargs="+", default=list(default), metavar=meta.get("metavar"),
                                help=f"{meta['help']}; replaces the default {' '.join(map(str, default))}"
                                if default else meta["help"])
        else:
            args = typing.get_args(hint)
            base = next((a for a in args if a is not type(None)), hint) if args else hint
            if base is float:
                base = finite_float(default)
            parser.add_argument(flag, dest=dest, type=base, default=default, choices=meta.get("choices"),
                                help=f"{meta['help']} (default: {default})")


def config_from_args(cls, args: argparse.Namespace, prefix: str = "", **overrides):
    """cls built from the flags add_config_flags made (fields without a flag keep their defaults)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if _nested(hints[f.name]):
            values[f.name] = config_from_args(hints[f.name], args, prefix if f.metadata.get("flat")
                                              else prefix + f.name + ".")
        elif hasattr(args, prefix + f.name):
            values[f.name] = getattr(args, prefix + f.name)
    values.update(overrides)
    return cls(**values)


def print_json(obj) -> None:
    """One JSON line on stdout (what every --json command prints last)."""
    print(json.dumps(obj, default=float))
