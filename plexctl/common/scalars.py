"""The value of a ``KEY=VALUE`` a user types (``submit --set``, ``up --setting``), read one way.

It owns ``parse_value``: YAML for the value (``[a, b]``, ``{k: v}``, ``null``, ``true``), with
YAML 1.2's numbers instead of YAML 1.1's: ``3e-4`` is a float (1.1: a string), ``1_000`` is no
number, ``0o17`` and ``0x1f`` are octal and hex, and a decimal with a leading zero (``010``:
YAML 1.1's silent 8) is refused in one line that names the key, since no reading of it is safe.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
FLOAT_12 = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
LEADING_ZERO = re.compile(r"^[-+]?0[0-9]+$")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's int and float resolvers in place of YAML 1.1's."""


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", INT_12, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT_12, list("-+.0123456789"))


def _int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith(("0o", "0x")):
        return int(text, 0)
    return int(text)


def _float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node)).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_constructor("tag:yaml.org,2002:int", _int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float)


def parse_value(key: str, raw: str) -> Any:
    """``raw`` read as a YAML 1.2 value; ``ValueError`` with one line naming ``key`` if it cannot be."""
    if LEADING_ZERO.match(raw.strip()):
        digits = raw.strip().lstrip("+-").lstrip("0") or "0"
        octal = f", 0o{digits} for octal" if set(digits) <= set("01234567") else ""
        raise ValueError(
            f"{key}: {raw.strip()!r} has a leading zero; write {digits} for the number{octal}, or quote it for a string"
        )
    try:
        return yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader, its number resolvers alone changed
    except yaml.YAMLError as e:
        raise ValueError(f"{key}: cannot parse value {raw!r}: {getattr(e, 'problem', e)}") from None
