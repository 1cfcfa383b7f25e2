"""Build argparse parsers from frozen config dataclasses (defaults and help live on the fields)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field whose metadata carries its command-line help."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _converter(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _converter(args[0])
    return hint


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field of cls, typed from its annotation, with its help and default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        kind = _converter(hints[f.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=help_text,
                                choices=f.metadata.get("choices"))


def from_args(cls: type[C], args: argparse.Namespace) -> C:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


__all__ = ["Path", "add_arguments", "from_args", "option"]
