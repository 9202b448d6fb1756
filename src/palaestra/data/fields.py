"""How a dataset config class takes its fields, so subclasses read like the tutorial's.

``class HaikuDataset(HuggingFaceDataset): input_column = "keywords"`` assigns a field with no
annotation, which pydantic refuses; the metaclass here gives such an assignment the base field
(its type, doc and checks, with the new default) before pydantic builds the class, refuses any
other public name with a did-you-mean, and serves field defaults as class attributes. Validation
errors become the TypeError or DatasetError the config has always raised, naming the field.
"""

from __future__ import annotations

import difflib
import threading
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from palaestra.data.splits import DatasetError

_building = threading.local()


class ConfigMeta(type(BaseModel)):
    """Lets a subclass set a field by plain assignment, and refuses any other public name."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any):
        _annotate_overrides(name, bases, namespace)
        # While pydantic builds the class, fields must not look like class attributes (see
        # __getattr__), or pydantic would take inherited defaults for new assignments.
        depth = getattr(_building, "depth", 0)
        _building.depth = depth + 1
        try:
            return super().__new__(mcs, name, bases, namespace, **kwargs)
        finally:
            _building.depth = depth

    def __getattr__(cls, name: str) -> Any:
        # pydantic keeps field defaults off the class; the tutorial reads them there
        # (``HaikuDataset.output_column``), so a finished class serves them.
        fields = cls.__dict__.get("__pydantic_fields__") or {}
        if name in fields and not getattr(_building, "depth", 0):
            field = fields[name]
            if field.default_factory is None:
                return field.default
        return super().__getattr__(name)


def _annotate_overrides(name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
    """Give each plain assignment of a base field that field, with its doc and checks, and the
    new default; TypeError for a public name that is no field."""
    fields: dict[str, FieldInfo] = {}
    for base in reversed(bases):
        fields.update(getattr(base, "__pydantic_fields__", None) or {})
    annotations = namespace.setdefault("__annotations__", {})
    for attr, value in list(namespace.items()):
        if attr.startswith("_") or attr == "model_config" or attr in annotations:
            continue
        if callable(value) or hasattr(value, "__get__"):  # methods, properties, validators
            continue
        if attr not in fields:
            raise TypeError(
                f"{name}.{attr} is not a field of {bases[0].__name__}{suggest(attr, fields)}"
            )
        annotations[attr] = fields[attr].annotation
        namespace[attr] = FieldInfo.merge_field_infos(fields[attr], default=value)


def suggest(name: str, fields: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} Known fields: {', '.join(fields)}"


def config_error(cls: type[BaseModel], err: ValidationError) -> Exception:
    """The first problem pydantic found, as the error this config has always raised."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, DatasetError):  # raised by a validator above, message and all
        return cause
    name = str(first["loc"][0]) if first["loc"] else "?"
    field = cls.model_fields.get(name)
    if first["type"].endswith("_type") and field is not None:
        hint = field.annotation
        return TypeError(
            f"{cls.__name__}.{name} must be {getattr(hint, '__name__', hint)}, "
            f"got {first['input']!r}"
        )
    return DatasetError(f"{cls.__name__}.{name}: {first['msg']}")
