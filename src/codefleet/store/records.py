"""Dataclasses to JSON and back, by their type hints: how a run directory keeps structured state (accepted
groups, demonstrations) without pickle.

    data = records.dumps(group)              # bytes: JSON
    group = records.loads(data, Group)       # the same Group, built from its declared types only

A run directory is shared storage that someone else may have written (docs/security.md), and unpickling runs
whatever code the file names. Decoding here builds only the types the caller names and the types their fields
declare (dataclasses, lists, tuples, dicts, enums, str/int/float/bool/None); anything else in the file is a
`RecordError` saying which field is wrong. Dicts whose keys are not strings (a tuple key) are written as a list of
[key, value] pairs.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import types
import typing
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")
MAX_DEPTH = 64
_SCALARS = (str, int, float, bool, type(None))
_PLAIN = (int, float, str, bool)
_PLAIN_SET = set(_PLAIN)  # far deeper than any record codefleet writes; a deeper file is hostile or corrupt


class RecordError(ValueError):
    """A record that does not match the type it is read as."""


def dumps(obj: Any) -> bytes:
    try:  # json walks the lists (most of a trajectory) itself; only dataclasses and enums come back to us
        return json.dumps(obj, default=_shallow, separators=(",", ":"), allow_nan=True).encode()
    except TypeError:  # a dict whose keys are not strings: the full walk writes it as pairs
        return json.dumps(_encode(obj), separators=(",", ":"), allow_nan=True).encode()


def _shallow(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    raise TypeError(f"cannot write a {type(obj).__name__} into a record; give it a dataclass or a plain type")


def loads(data: bytes | str, cls: type[T]) -> T:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise RecordError(f"not a JSON record: {str(e)[:200]}") from None
    return _decode(raw, cls, "$", 0)


def _encode(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return _encode(obj.value)
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__pairs__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        if set(map(type, obj)) <= _PLAIN_SET:  # token ids, logprobs: most of a trajectory, kept as they are
            return obj
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise TypeError(f"cannot write a {type(obj).__name__} into a record; give it a dataclass or a plain type")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


@cache
def _shape(tp: Any) -> tuple[Any, tuple]:
    return typing.get_origin(tp), typing.get_args(tp)


def _decode(raw: Any, tp: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise RecordError(f"{where}: nested deeper than {MAX_DEPTH}")
    origin, args = _shape(tp)
    if tp is Any:
        return _plain(raw, where, depth)
    if origin in (typing.Union, types.UnionType):
        return _decode_union(raw, tp, args, where, depth)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(raw, tp, where, depth)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            raise RecordError(f"{where}: {raw!r} is not a {tp.__name__}") from None
    if origin is list or tp is list:
        return _decode_list(raw, args, where, depth)
    if origin is tuple or tp is tuple:
        return _decode_tuple(raw, args, where, depth)
    if origin is dict or tp is dict:
        return _decode_dict(raw, args, where, depth)
    if tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise RecordError(f"{where}: expected a number, got {type(raw).__name__}")
    if tp in (str, int, bool) or tp is type(None):
        if type(raw) is tp or (tp is type(None) and raw is None):
            return raw
        raise RecordError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(raw).__name__}")
    raise RecordError(f"{where}: records cannot hold a {tp!r}")


def _decode_union(raw: Any, tp: Any, args: tuple, where: str, depth: int) -> Any:
    if raw is None and type(None) in args:
        return None
    if all(a in _SCALARS for a in args):
        # metadata's str | int | float also carries lists in practice: plain JSON is as safe as declared scalars
        return _plain(raw, where, depth)
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return _decode(raw, arm, where, depth)
        except RecordError as e:
            errors.append(str(e))
    raise RecordError(errors[0] if len(errors) == 1 else f"{where}: matches none of {tp}")


def _decode_dataclass(raw: Any, tp: type, where: str, depth: int) -> Any:
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: expected an object for {tp.__name__}, got {type(raw).__name__}")
    hints, fields = _hints(tp), {f.name: f for f in dataclasses.fields(tp)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise RecordError(f"{where}: {tp.__name__} has no field {sorted(unknown)[0]!r}")
    kwargs = {
        name: _decode(value, hints[name], f"{where}.{name}", depth + 1)
        for name, value in raw.items()
        if fields[name].init
    }
    try:
        return tp(**kwargs)
    except TypeError as e:
        raise RecordError(f"{where}: {e}") from None


def _decode_list(raw: Any, args: tuple, where: str, depth: int) -> list:
    if not isinstance(raw, list):
        raise RecordError(f"{where}: expected a list, got {type(raw).__name__}")
    item = args[0] if args else Any
    if item in _PLAIN and (kinds := set(map(type, raw))) <= ({float, int} if item is float else {item}):
        return list(map(float, raw)) if int in kinds else raw  # the common case, checked in C
    inner = _shape(item)
    if (
        inner[0] is list
        and inner[1]
        and inner[1][0] in (int, str, bool)
        and all(type(row) is list and set(map(type, row)) <= {inner[1][0]} for row in raw)
    ):
        return raw  # routed experts: a list of ids per token
    return [_decode(v, item, f"{where}[{i}]", depth + 1) for i, v in enumerate(raw)]


def _decode_tuple(raw: Any, args: tuple, where: str, depth: int) -> tuple:
    if not isinstance(raw, list):
        raise RecordError(f"{where}: expected a list for a tuple, got {type(raw).__name__}")
    if args and args[-1] is not Ellipsis:
        if len(args) != len(raw):
            raise RecordError(f"{where}: expected {len(args)} items, got {len(raw)}")
        return tuple(_decode(v, a, f"{where}[{i}]", depth + 1) for i, (v, a) in enumerate(zip(raw, args, strict=True)))
    item = args[0] if args else Any
    return tuple(_decode(v, item, f"{where}[{i}]", depth + 1) for i, v in enumerate(raw))


def _decode_dict(raw: Any, args: tuple, where: str, depth: int) -> dict:
    key_t, value_t = args if args else (Any, Any)
    if isinstance(raw, dict) and set(raw) == {"__pairs__"} and isinstance(raw["__pairs__"], list):
        pairs = raw["__pairs__"]
    elif isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        raise RecordError(f"{where}: expected an object, got {type(raw).__name__}")
    out = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise RecordError(f"{where}: entry {i} is not a [key, value] pair")
        out[_decode(pair[0], key_t, f"{where}<key {i}>", depth + 1)] = _decode(
            pair[1], value_t, f"{where}[{pair[0]!r}]", depth + 1
        )
    return out


def _plain(raw: Any, where: str, depth: int) -> Any:
    """A value declared as Any: JSON's own types only, depth-checked."""
    if depth > MAX_DEPTH:
        raise RecordError(f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(raw, list):
        return [_plain(v, where, depth + 1) for v in raw]
    if isinstance(raw, dict):
        return {k: _plain(v, where, depth + 1) for k, v in raw.items()}
    return raw
