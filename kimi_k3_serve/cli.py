"""The ``kimi-k3-serve`` command.

Each subcommand lives in ``kimi_k3_serve.commands.<name>`` and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them up and turns our errors into one line and an exit code:
0 success / fits, 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from typing import Sequence

from kimi_k3_serve import __version__
from kimi_k3_serve.errors import ConfigError, DoesNotFitError, KimiK3ServeError
from kimi_k3_serve.tokens import mask_tokens

EXIT_OK = 0
EXIT_DOES_NOT_FIT = 1
EXIT_BAD_INPUT = 2

# name -> (module, one-line help). Modules are imported only when their command runs, so
# `kimi-k3-serve memory` never pays for Ray or vLLM imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "memory": ("kimi_k3_serve.commands.memory", "per-GPU memory of one layout (vLLM 0.32 accounting)"),
    "plan": ("kimi_k3_serve.commands.plan", "find the best layout of a model on a declared cluster"),
    "check": ("kimi_k3_serve.commands.check", "will this deploy config fit its cluster? (CI/CD gate)"),
    "prefetch": ("kimi_k3_serve.commands.prefetch", "put each node's part of the checkpoint on its own disk (Ray task per node)"),
    "render": ("kimi_k3_serve.commands.render", "write a Ray cluster launcher / KubeRay file from a deploy config"),
    "rehearse": ("kimi_k3_serve.commands.rehearse", "start vLLM's real engine on dummy weights and compare with the plan"),
}


def _available_commands() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own bad-input path: same exit code and one line, as ours
        self.exit(EXIT_BAD_INPUT, f"error: {mask_tokens(one_line_argparse_error(message, self.prog))}\n")


_ARGPARSE_MESSAGES = [
    (re.compile(r"argument (?P<field>[^:]+): invalid choice: (?P<value>.+?) \(choose from (?P<allowed>.+)\)$"),
     "{field}: got {value}; expected one of {allowed}"),
    (re.compile(r"argument (?P<field>[^:]+): invalid (?P<kind>int|float) value: (?P<value>.+)$"),
     "{field}: got {value}; expected {kind_words}"),
    (re.compile(r"argument (?P<field>[^:]+): expected (?P<allowed>.*argument.*)$"), "{field}: got no value; expected {allowed}"),
    (re.compile(r"argument (?P<field>[^:]+): (?P<rest>got .+)$"), "{field}: {rest}"),  # our argtypes' words
    (re.compile(r"the following arguments are required: (?P<field>.+)$"), "{field}: got nothing; expected it (required)"),
    (re.compile(r"unrecognized arguments: (?P<value>.+)$"), "arguments: got {value!r}; expected the options `{prog} COMMAND --help` lists"),
]


def one_line_argparse_error(message: str, prog: str) -> str:
    """argparse's message in our form, ``FIELD: got VALUE; expected ALLOWED``, when it is one of those we know."""
    for pattern, form in _ARGPARSE_MESSAGES:
        match = pattern.match(message)
        if match:
            parts = match.groupdict()
            kind_words = {"int": "an integer", "float": "a number"}.get(parts.get("kind", ""), "")
            return form.format(**parts, kind_words=kind_words, prog=prog)
    return message.replace("\n", " ")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kimi-k3-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kimi-k3-serve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in _available_commands().items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args))
    except ConfigError as exc:
        print(f"error: {mask_tokens(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DoesNotFitError as exc:
        print(f"does not fit: {mask_tokens(str(exc))}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except KimiK3ServeError as exc:
        print(f"error: {mask_tokens(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
