"""Building blocks of file models: the strict base model, choices from existing tuples, regex strings."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict


class FileModel(BaseModel):
    """A mapping of a user file: unknown keys are errors and values are not coerced (``"4"`` is no integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def one_of(values: Iterable[Any]) -> Any:
    """``Literal[*values]``, for choices kept in a tuple or dict elsewhere (errors list them, "did you mean").

    A value must also have a choice's type: ``4.0`` or ``true`` is not the choice ``4`` (a Literal alone takes them).
    """
    choices = tuple(values)
    types = {type(choice) for choice in choices}

    def same_type(value: Any) -> Any:
        if type(value) not in types:
            shown = ", ".join(map(str, choices))
            raise ValueError(f"expected one of {shown}, got {type(value).__name__} {value!r}")
        return value

    return Annotated[Literal[choices], BeforeValidator(same_type)]  # type: ignore[valid-type]


def compiles(pattern: str) -> str:
    """``pattern`` unchanged; a ValueError saying why when it is not a valid regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"'{pattern}' is not a valid regular expression ({exc}); escape it") from exc
    return pattern


Regex = Annotated[str, AfterValidator(compiles)]
