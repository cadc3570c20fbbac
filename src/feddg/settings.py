"""The pydantic base of every settings model (the config's sections, methods' and merges' parameters, DP settings,
augmentations, roster entries): unknown keys are errors, a boolean is never read as a number, and a float field takes
only finite numbers (YAML's ``.inf`` passed ``optim.lr``'s ``gt=0`` and trained to NaN weights; ``None`` is each
optional field's "off").

pydantic's lax mode turns ``true`` into 1 for an ``int`` or ``float`` field, and YAML reads ``yes``, ``on`` and
``true`` as booleans, so ``-o federation.rounds=yes`` ran one round. Here a boolean given to a field that does not
take one (``int``, ``float | None``, ``list[int]``, ...) is refused at that field; fields that take booleans
(``bool``, ``Any``, unions with them) are left to pydantic.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

BOOLEAN_NUMBER = PydanticCustomError("boolean_number", "expected a number, got a boolean")


def _members(annotation: Any) -> list[Any]:
    """A type's alternatives (a union's members, else the type itself), each without ``Annotated`` constraints."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for a in get_args(annotation) for m in _members(a)]
    return [annotation]


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type accepts a boolean as a boolean (not as a number)."""
    return any(m is bool or m is Any or (get_origin(m) is Literal and any(isinstance(a, bool) for a in get_args(m)))
               for m in _members(annotation))


def _numeric(annotation: Any) -> bool:
    """Whether the type is (or has among its alternatives) ``int`` or ``float``: what pydantic coerces a boolean to."""
    return any(m in (int, float) for m in _members(annotation))


def booleans_for_numbers(annotation: Any, value: Any) -> list[tuple[tuple[int, ...], bool]]:
    """Where ``value`` holds a boolean that a field of type ``annotation`` would read as a number: ``[((), True)]`` for
    the value itself, ``[((i,), v), ...]`` for the items of a list of numbers; ``[]`` if none."""
    if _takes_bool(annotation):
        return []
    if isinstance(value, bool):
        return [((), value)] if _numeric(annotation) else []
    if isinstance(value, list):
        items = [get_args(m)[0] for m in _members(annotation) if get_origin(m) in (list, tuple) and get_args(m)]
        if items and not any(_takes_bool(t) for t in items) and any(_numeric(t) for t in items):
            return [((i,), v) for i, v in enumerate(value) if isinstance(v, bool)]
    return []


class Settings(BaseModel):
    """Unknown keys are errors; a boolean for a number (or in a list of numbers) is an error at that field, and so is
    an infinite or NaN float.

    One check per model on its raw input (pydantic refuses a "before" validator on a discriminated union's tag, so
    not one per field), each error raised at its field's own location (``federation.rounds``, ``sweep.seeds.1``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        errors: list[InitErrorDetails] = []
        for name, field in cls.model_fields.items():
            key = field.alias if field.alias is not None and field.alias in data else name
            if key in data:
                errors += [InitErrorDetails(type=BOOLEAN_NUMBER, loc=(key, *at), input=v)
                           for at, v in booleans_for_numbers(field.annotation, data[key])]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


def key_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key of a settings model as a path, the keys of its nested sections included (not inside lists or
    free mappings such as ``params``)."""
    for name, field in model.model_fields.items():
        yield (*prefix, name)
        for member in _members(field.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                yield from key_paths(member, (*prefix, name))


def meant_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[tuple[str, ...]]:
    """The keys an unknown key at ``loc`` may have meant: the closest spelling beside it (``federation.roundz`` ->
    ``federation.rounds``), else the same name in other sections (``engine`` -> ``federation.engine``)."""
    *parents, leaf = loc
    if any(isinstance(p, int) for p in parents):  # an item of a list: key_paths does not reach inside lists
        return []
    paths = list(key_paths(model))
    beside = {path[-1]: path for path in paths if list(path[:-1]) == parents}
    if close := difflib.get_close_matches(str(leaf), list(beside), n=1, cutoff=0.75):
        return [beside[close[0]]]
    return [path for path in paths if path[-1] == leaf]
