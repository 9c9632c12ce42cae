"""Every option and argument of every `gpuherd` command says what it is in `-h` (many said only
their name: `--json`, `--kind`, `job`, `--timeout`)."""

from __future__ import annotations

import argparse

from apps.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: str = "gpuherd") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{path} {name}")
    return found


def test_every_option_of_every_command_has_a_help_line() -> None:
    silent = [
        f"{path} {action.option_strings[0] if action.option_strings else action.dest}"
        for path, parser in _commands(build_parser())
        for action in parser._actions
        if action.help is None and not isinstance(action, argparse._SubParsersAction)
    ]
    assert silent == []
