"""Config records as JSON, one encoder and one decoder for every record moejax writes to disk
(converted model directories, checkpoint metadata, placement controller specs).

`record_to_json` turns a frozen dataclass into plain JSON values: nested records become objects,
tuples become lists, non-finite floats the strings `"inf"`, `"-inf"`, `"nan"` (JSON has none).
`record_from_json(cls, obj)` rebuilds `cls` from the field annotations alone: a field typed as a
record (`MoEConfig`, `MLAConfig | None`, ...) is rebuilt as that record, a tuple field as a tuple,
so a record added later round-trips with no line written for it here. A field missing from `obj`
takes its default (a file written before the field existed), a key renamed since is read under
its new name (`RENAMED`), and a key that names no field is an error naming it. Validation is the
records' own (`__post_init__`).

`flatten` / `unflatten` turn the nested form into one level of dotted keys (`"moe.d_ff"`) and
back: the layout of a training checkpoint's metadata, whose keys `ResumeMismatch` names.

>>> import moejax
>>> cfg = moejax.MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2)
>>> moejax.record_from_json(moejax.MoEConfig, moejax.record_to_json(cfg)) == cfg
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing

__all__ = ["RENAMED", "flatten", "record_from_json", "record_to_json", "unflatten"]

# Keys renamed since a file could have been written: {record class name: {old: new}}.
RENAMED = {"MoEConfig": {"dispatch": "drop_policy"}}
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def record_to_json(record) -> dict:
    """`record` (a dataclass instance) as a dict of JSON values (module docstring)."""
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"record_to_json: {type(record).__name__} is not a dataclass instance")
    return {f.name: _encode(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _encode(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return record_to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def record_from_json(cls: type, obj: dict, *, where: str | None = None):
    """The `cls` record `obj` encodes (the inverse of `record_to_json`).

    Args:
      cls: the record's class (a dataclass).
      obj: its JSON form; keys renamed since (`RENAMED`) are read under their new names,
        fields it lacks take their defaults.
      where: a prefix for error messages (default: the class name).

    Raises:
      ValueError: `obj` is not an object, names a field `cls` does not have, or a value the
        record refuses (its own message, with the field's dotted path).
      TypeError: a required field is missing.
    """
    where = where or cls.__name__
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    renamed = RENAMED.get(cls.__name__, {})
    obj = {renamed.get(k, k): v for k, v in obj.items()}
    hints = _hints(cls)
    unknown = sorted(set(obj) - set(hints))
    if unknown:
        raise ValueError(f"{where}: no field {unknown[0]!r} (fields: {sorted(hints)})")
    kwargs = {k: _decode(hints[k], v, f"{where}.{k}") for k, v in obj.items()}
    return cls(**kwargs)


@functools.cache
def _hints(cls: type) -> dict:
    """`{field name: annotation}` of the dataclass `cls`, string annotations resolved."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init}


def _decode(hint, value, where: str):
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        records = [a for a in members if dataclasses.is_dataclass(a)]
        if records and isinstance(value, dict):
            return record_from_json(records[0], value, where=where)
        tuples = [a for a in members if typing.get_origin(a) is tuple]
        if tuples and isinstance(value, list):
            return _decode(tuples[0], value, where)
        if float in members and value in _NONFINITE:
            return _NONFINITE[value]
        return value
    if dataclasses.is_dataclass(hint):
        return record_from_json(hint, value, where=where)
    if origin is tuple and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if args and len(args) == len(value):
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in pairs)
        return tuple(value)
    if hint is float and value in _NONFINITE:
        return _NONFINITE[value]
    return value


def flatten(obj: dict, prefix: str = "") -> dict:
    """A nested JSON object as one level of dotted keys: `{"moe": {"d_ff": 8}}` ->
    `{"moe.d_ff": 8}` (an empty object stays one key)."""
    out = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def unflatten(flat: dict) -> dict:
    """The inverse of `flatten`."""
    out: dict = {}
    for key, value in flat.items():
        *outer, last = key.split(".")
        node = out
        for part in outer:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"key {key!r}: {part!r} is both a value and a record")
        node[last] = value
    return out
