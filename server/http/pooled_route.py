"""PooledJSONRoute: a FastAPI route whose large JSON body is parsed and validated on the frontend pool.

FastAPI parses a body with ``json.loads`` and validates it with pydantic on the event loop: for a 20 MB
prompt that was ~300 ms (measured) in which no other request, /health included, was served. Moving the
same calls to a thread is not enough, because each is one C call holding the GIL, which the loop needs.
A router built with ``APIRouter(route_class=PooledJSONRoute)`` (FastAPI's documented hook for a custom
request step) does it for a body above ``POOLED_BODY_BYTES`` on ``cpu_pool``, in short GIL holds:
``parse_json_body`` (json_body.py) parses long strings and id arrays piece by piece, and
``validate_body`` validates a top-level list longer than ``LONG_LIST`` items slice by slice (the model
is validated with a one-item stand-in, the checked list set afterwards). FastAPI then receives the
validated model, which pydantic accepts as it is.

Errors keep their usual 400s: a body that does not validate is handed to FastAPI as the parsed dict
(FastAPI validates it again and reports as always), one that is not JSON as nothing, so FastAPI parses
it and reports the JSON error itself.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import lru_cache
from typing import Any

from annotated_types import MaxLen
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from flashtier.server.http.json_body import parse_json_body

__all__ = ["LONG_LIST", "POOLED_BODY_BYTES", "PooledJSONRoute", "parse_body", "validate_body"]

POOLED_BODY_BYTES = 256 << 10  # below this, parsing inline costs less than the thread hop (< 1 ms)
LONG_LIST = 1 << 16  # top-level lists longer than this are validated in slices of this many items


@lru_cache(maxsize=64)
def _field_adapter(model: type[BaseModel], name: str) -> tuple[TypeAdapter[Any], int | None]:
    """A strict validator of field `name`'s type, and the field's own max_length (a slice cannot check it)."""
    field = model.model_fields[name]
    limit = next((m.max_length for m in field.metadata if isinstance(m, MaxLen)), None)
    return TypeAdapter(field.annotation), limit


def validate_body(model: type[BaseModel], tree: Any) -> BaseModel:
    """``model.model_validate(tree)``, with long top-level lists validated slice by slice (module doc).
    Raises ``ValidationError``, or ``ValueError`` for a list over its field's max_length."""
    long_lists = {}
    if isinstance(tree, dict):
        for name, field in model.model_fields.items():
            key = field.alias or name
            value = tree.get(key)
            if isinstance(value, list) and len(value) > LONG_LIST:
                long_lists[name] = (key, value)
    if not long_lists:
        return model.model_validate(tree)
    stand_in = {**tree, **{key: value[:1] for key, value in long_lists.values()}}
    instance = model.model_validate(stand_in)
    for name, (_, value) in long_lists.items():
        adapter, limit = _field_adapter(model, name)
        if limit is not None and len(value) > limit:
            raise ValueError(f"{name} has more than {limit} items")
        checked: list[Any] = []
        for start in range(0, len(value), LONG_LIST):
            checked += adapter.validate_python(value[start:start + LONG_LIST], strict=True)
        setattr(instance, name, checked)
    return instance


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """`body` as a validated `model`, else as parsed JSON (it does not validate), else None (not JSON)."""
    try:
        tree = parse_json_body(body)
    except (ValueError, RecursionError):
        return None
    try:
        return validate_body(model, tree)
    except ValueError:  # ValidationError is one
        return tree


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    field = route.body_field
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


class PooledJSONRoute(APIRoute):
    """An ``APIRoute`` that parses and validates a large JSON body on ``state.cpu_pool`` (module doc)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def pooled_handler(request: Request) -> Response:
            body = await request.body()  # already read (and size-checked) by RequestBodyMiddleware
            if len(body) > POOLED_BODY_BYTES:
                parsed = await request.app.state.flashtier.cpu_pool.run(parse_body, model, body)
                if parsed is not None:
                    # Starlette's Request.json() returns this cached value; FastAPI calls it next
                    request._json = parsed  # noqa: SLF001
            return await handler(request)

        return pooled_handler
