"""`specquant VERB ...`: one module per verb; each exposes add_parser(subparsers) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import sys

from specquant.errors import SpecquantError
from specquant.util.flags import Parser

# verb -> module with add_parser()/run(); a module that does not exist yet is simply not offered
VERBS = {
    "generate": "specquant.spec_decode.cli",
    "models": "specquant.model.cli",
    "quantize": "specquant.quant.cli",
    "bench": "specquant.bench.cli",
    "demo": "specquant.bench.demo",
    "export": "specquant.export.cli",
    "gate": "specquant.gate.cli",
    "regen": "specquant.train.regen",
    "distill": "specquant.train.cli",
    "serve": "specquant.serve.cli",
    "latency": "specquant.serve.latency",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = Parser(prog="specquant", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    modules = {}
    for verb, mod_name in VERBS.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:
                continue
            raise
        mod.add_parser(sub)
        modules[verb] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    try:
        return modules[args.verb].run(args) or 0
    except SpecquantError as e:
        print(f"specquant {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
