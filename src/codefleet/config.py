"""One config style for every component: typed dataclasses, loaded from YAML,
overridden from the command line with `key.sub=value`.

    cfg = load_config(SandboxConfig, "sandbox.yaml", ["memory_mb=512", "env.FOO=bar"])

Values from the command line are parsed as YAML scalars (`1`, `0.5`, `true`,
`[a, b]`), then checked against the field's type, so a typo fails loudly
with the field's name instead of silently doing nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override does not match the config's fields."""


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    tree[keys[-1]] = value


def _coerce(tp: Any, value: Any, where: str, default: Any = None, root: type | None = None) -> Any:
    """`value` checked against the type `tp`; a section is merged into `default`, the field's default instance.
    `root` is the outermost config class, whose keys an unknown key's error suggests."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, where, default if isinstance(default, tp) else None, root=root)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(opt, value, where, default, root)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not a {tp}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp) or (Any, Any)
        return {str(k): _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if isinstance(value, bool) and tp in (int, float):  # bool is an int to Python, never to a config
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1, which PyYAML reads, takes `1e-4` for text; a float field means 0.0001
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        hint = " (quote it to keep it as text)" if tp is str and (value is None or isinstance(value, bool)) else ""
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}{hint}")
    return value


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def dotted_keys(cls: type) -> list[str]:
    """Every settable key of the config class `cls`, dotted (`rl.loss.kl_coef`), depth first."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        keys += [f"{f.name}.{k}" for k in dotted_keys(tp)] if dataclasses.is_dataclass(tp) else [f.name]
    return keys


def _unknown_key(name: str, where: str, fields: list[str], root: type | None) -> ConfigError:
    """One sentence for the unknown key `name` of the section at `where`, naming the keys it may have meant: in
    the same section, else anywhere in `root` (a key put in the wrong section), else the section's keys."""
    prefix = f"{where}." if where else ""
    close = [prefix + k for k in difflib.get_close_matches(name, fields, n=3)]
    if not close and root is not None:
        everywhere = dotted_keys(root)
        close = [k for k in everywhere if k.rsplit(".", 1)[-1] == name]
        close = close or difflib.get_close_matches(prefix + name, everywhere, n=3)
    hint = (
        f"did you mean {' or '.join(close)}?"
        if close
        else f"the keys {'of ' + where if where else 'here'} are {', '.join(sorted(fields))}"
    )
    return ConfigError(f"unknown config key {prefix + name!r}: {hint}")


def from_dict(cls: type[T], data: dict, where: str = "", base: T | None = None, root: type | None = None) -> T:
    """`cls` with the fields in `data` set, the others as in `base` (or their defaults).

    A section keeps the defaults its parent gives it: `rl.reward.cost_per_turn=0.1` changes that one field of
    the run's reward, not the other fields back to `RewardConfig()`'s. A key `cls` does not have is refused,
    naming the keys of `root` (default `cls`) closest to it; a value a section's own check refuses is refused
    naming the section.
    """
    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise _unknown_key(unknown[0], where, list(fields), root)
    kwargs = {}
    for k, v in data.items():
        default = getattr(base, k) if base is not None else _field_default(fields[k])
        kwargs[k] = _coerce(hints[k], v, f"{where}.{k}" if where else k, default, root)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # the class's own check (__post_init__), or a required field missing
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def read_config(path: str | None = None, overrides: list[str] | None = None) -> dict:
    """The mapping the YAML file at `path` (optional) holds, with the `key.sub=value` overrides applied."""
    data: dict = {}
    if path:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            raise ConfigError(
                f"override {item!r}: {raw!r} is not a YAML value; quote it, e.g. {key.strip()}='\"{raw}\"'"
            ) from None
        _set_path(data, key.strip(), value)
    return data


def load_config(cls: type[T], path: str | None = None, overrides: list[str] | None = None, base: T | None = None) -> T:
    """`cls` from the YAML file at `path` (optional), then `key.sub=value` overrides; fields neither sets keep
    their value in `base` (default: the field defaults)."""
    return from_dict(cls, read_config(path, overrides), base=base)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
