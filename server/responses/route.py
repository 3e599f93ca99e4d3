"""The OpenAI Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE /v1/responses/{id}``.

    ResponsesRequest ─▶ earlier turns (previous_response_id, from the store) + input (item_reference
    resolved) ─▶ translate (responses/translate.py) ─▶ ChatCompletionRequest ─▶ prepare_chat_job
    ─▶ Generation ─▶ ResponsesRenderer (responses/stream.py) ─▶ SSE events | one response object
                                                              └─▶ the store (responses/store.py)

The generation is chat's (prepare_chat_job), so prompt, thinking, tool parsing, sampling and enforcement
are the same as /v1/chat/completions'. Chat-side error params are renamed to the Responses field a client
sent (``max_completion_tokens`` -> ``max_output_tokens``, ``messages`` -> ``input``, ...).

Storing: with ``store`` true (the default) a completed or incomplete response is written before the
client gets it (before ``response.completed`` when streaming), so the next turn can name it at once.
A store failure never fails the request (the response is just not found later). ``store: false`` keeps
nothing. Under ``--cache-isolation per-key`` a stored response belongs to the API key that created it:
for any other key it does not exist (404), as its cached prefix does not. Refused: ``background: true``,
``conversation``, ``prompt`` (400, named).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flashtier.server.http.auth import authenticated_key
from flashtier.server.openai.chat_job import ChatJob, prepare_chat_job
from flashtier.server.http.errors import APIError, BadRequest
from flashtier.server.serving.generation import json_response
from flashtier.server.http.pooled_route import PooledJSONRoute
from flashtier.server.protocol.request_models import ChatCompletionRequest
from flashtier.server.serving.request_checks import check_text
from flashtier.server.response_store.store import ResponseStore, StoredResponse
from flashtier.server.responses.response_object import DeletedResponse, ResponseEnvelope, ResponseObject
from flashtier.server.responses.output import OutputBuilder, response_id_of_item
from flashtier.server.responses.protocol import InputItem, ResponsesRequest, parse_input_item
from flashtier.server.responses.stream import ResponsesRenderer, stream_responses
from flashtier.server.responses.translate import item_dict, parse_input, resolve_references, translate
from flashtier.server.serving.state import ServerState, get_state

router = APIRouter(route_class=PooledJSONRoute)  # large bodies are parsed off the event loop
logger = logging.getLogger(__name__)

# chat's name of a field -> the Responses field it came from (for the `param` of an error)
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "cache_salt": "prompt_cache_key", "reasoning_effort": "reasoning.effort"}
ENCRYPTED_REASONING = "reasoning.encrypted_content"
OWNER_DOMAIN = b"flashtier/response-owner/v1\x00"


def _not_found(response_id: str, param: str | None = None, code: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id {response_id!r} not found.", param=param, code=code,
                    type="invalid_request_error")


def _owner(state: ServerState, request: Request) -> str | None:
    """Who may read what this request stores: its API key's digest under per-key isolation, else anyone."""
    key = authenticated_key(request.scope)
    if state.settings.cache_isolation != "per-key" or key is None:
        return None
    return hashlib.sha256(OWNER_DOMAIN + key.encode("utf-8")).hexdigest()


async def _lookup(store: ResponseStore, response_id: str, owner: str | None) -> StoredResponse | None:
    """The stored response, if `owner` may read it (another tenant's is as absent as an unknown one)."""
    record = await store.get(response_id)
    return record if record is not None and record.owner == owner else None


def _store(state: ServerState) -> ResponseStore:
    store = state.response_store
    if store is None:  # create_app always builds one; a bare ServerState (tests of other parts) has none
        raise APIError(503, "the response store is not configured", code="not_ready")
    return store


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise BadRequest("background responses are not supported by this server", param="background")
    if body.conversation is not None:
        raise BadRequest("conversations are not supported by this server; use previous_response_id",
                         param="conversation")
    if body.prompt is not None:
        raise BadRequest("prompt templates are not supported by this server", param="prompt")
    for name, value in body.model_dump(by_alias=True, exclude_none=True).items():
        check_text(value, name)  # everything may be echoed or stored: no lone surrogates anywhere


async def _conversation(store: ResponseStore, body: ResponsesRequest,
                        owner: str | None) -> tuple[list[dict[str, Any]], list[InputItem]]:
    """(the earlier turns' items, this request's items with references resolved); 404/400 as APIError."""
    prior: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        record = await _lookup(store, body.previous_response_id, owner)
        if record is None:
            raise _not_found(body.previous_response_id, "previous_response_id", "previous_response_not_found")
        prior = record.conversation()

    async def find(item_id: str) -> dict[str, Any] | None:
        for raw in prior:
            if raw.get("id") == item_id:
                return raw
        source = response_id_of_item(item_id)
        record = await _lookup(store, source, owner) if source is not None else None
        return next((raw for raw in record.conversation() if raw.get("id") == item_id), None) if record else None

    return prior, await resolve_references(parse_input(body), find)


async def _prepare(state: ServerState, request: Request, chat: ChatCompletionRequest, response_id: str) -> ChatJob:
    try:
        return await prepare_chat_job(state, request, chat, request_id=response_id, chunk_object="response")
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = get_state(request)
    store = _store(state)
    _refuse_unsupported(body)
    response_id = f"resp_{uuid.uuid4().hex}"
    owner = _owner(state, request)
    prior, own = await _conversation(store, body, owner)
    conversation = [parse_input_item(raw, f"previous_response_id (item {i})") for i, raw in enumerate(prior)]
    try:
        tr = translate(body, [*conversation, *own], own_start=len(conversation))
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise
    if tr.dropped_tools:  # one note per request: agents send hosted tools by default
        kinds = ", ".join(sorted(set(tr.dropped_tools)))
        logger.info("%s: ignoring tools this server cannot run: %s", response_id, kinds)
    job = await _prepare(state, request, tr.chat, response_id)
    keep = body.store is not False
    envelope = ResponseEnvelope.of(response_id, job.model, body, tr, keep)
    builder = OutputBuilder(response_id, encrypted_reasoning=ENCRYPTED_REASONING in (body.include or ()))
    renderer = ResponsesRenderer(job.gen, envelope, builder, streaming=bool(body.stream))
    input_items = [*prior, *(item_dict(item) for item in own)]

    async def save(final: dict[str, Any]) -> None:
        if keep and final["status"] != "failed":
            await store.put(StoredResponse(final, input_items, owner))

    if body.stream:
        return await stream_responses(job.gen, renderer, save)
    response = await json_response(request, job.gen, renderer)
    if response.status_code == 200:
        await save(renderer.result())
    return response


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def get_response(response_id: str, request: Request) -> JSONResponse:
    state = get_state(request)
    record = await _lookup(_store(state), response_id, _owner(state, request))
    if record is None:
        raise _not_found(response_id)
    return JSONResponse(record.response)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    state = get_state(request)
    store = _store(state)
    if await _lookup(store, response_id, _owner(state, request)) is None or not await store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
