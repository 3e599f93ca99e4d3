"""GET /v1/models, /v1/models/{model}, /health, /metrics, /version; POST /tokenize, /detokenize.

/health is 200 ``{"status": "ok"}`` once the engine accepts requests and 503 before (loading) and
after (stopped). /metrics is the Prometheus text exposition of the app's registry. /version is
``{"version": ...}`` (as vLLM's). /tokenize takes either ``prompt`` (text; control-token text becomes
control tokens) or ``messages`` (rendered exactly as /v1/chat/completions renders them, tools and
thinking included), and needs no engine.

/tokenize and /detokenize need the API key when one is set (auth.py) and take bodies up to
--max-tokenize-bytes (app.py). Anything but a tiny input is tokenized, detokenized and rendered to JSON
on the frontend pool (frontend_pool.py), so a large one never holds the event loop.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flashtier import __version__
from flashtier.server.openai.chat_prompt import render_chat
from flashtier.server.http.errors import BadRequest
from flashtier.server.http.frontend_pool import INLINE_CHARS
from flashtier.server.http.json_chunks import json_array
from flashtier.server.http.pooled_route import PooledJSONRoute
from flashtier.server.protocol.request_models import DetokenizeRequest, TokenizeRequest
from flashtier.server.protocol.response_models import (
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from flashtier.server.serving.request_checks import check_text
from flashtier.server.config.settings import DEMO_PRESET, demo_note
from flashtier.server.serving.state import ServerState, get_state

router = APIRouter(route_class=PooledJSONRoute)
_VERSION_SCHEMA = {"type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]}


def _cards(state: ServerState) -> list[dict]:
    settings = state.settings
    root = settings.model_dir or f"preset:{settings.effective_preset}"
    note = demo_note(settings.effective_preset or DEMO_PRESET) if settings.is_demo else None
    ext = {"demo": settings.is_demo, "note": note}
    return [
        ModelCard(id=name, created=state.created, root=root, max_model_len=state.max_model_len,
                  flashtier=ext).model_dump()
        for name in settings.model_names
    ]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _cards(get_state(request))})


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def get_model(model: str, request: Request) -> JSONResponse:
    state = get_state(request)
    name = state.resolve_model(model)
    return JSONResponse(next(card for card in _cards(state) if card["id"] == name))


@router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> JSONResponse:
    get_state(request).require_engine()
    return JSONResponse({"status": "ok"})


@router.get("/version", responses={200: {"content": {"application/json": {"schema": _VERSION_SCHEMA}}}})
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    registry = get_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("send exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        prompt = body.prompt
        if len(prompt) > INLINE_CHARS:
            ids = await state.cpu_pool.run(_encode_prompt, state, prompt)
        else:
            ids = _encode_prompt(state, prompt)
    else:
        assert body.messages is not None
        rendered = await render_chat(state, body.messages, tools=body.tools, tool_choice=None,
                                     reasoning_effort=body.reasoning_effort,
                                     chat_template_kwargs=body.chat_template_kwargs,
                                     add_generation_prompt=body.add_generation_prompt)
        ids = rendered.ids
    render = (_tokenize_json, state, ids, body.return_token_strs)
    content = await state.cpu_pool.run(*render) if len(ids) > INLINE_CHARS else _tokenize_json(*render[1:])
    return Response(content, media_type="application/json")


def _encode_prompt(state: ServerState, prompt: str) -> list[int]:
    """The ids of /tokenize's `prompt` (control-token text allowed); 400 on invalid Unicode."""
    check_text(prompt, "prompt")
    return state.tokenizer.encode(prompt, allow_special=True)


def _tokenize_json(state: ServerState, ids: list[int], with_strs: bool) -> bytes:
    """/tokenize's answer as JSON bytes; token texts are rendered slice by slice, never listed whole."""
    parts = [b'{"count":%d,"max_model_len":%s,"tokens":' % (len(ids), json.dumps(state.max_model_len).encode()),
             *json_array(ids), b',"token_strs":']
    parts += json_array(ids, lambda t: state.token_texts.get(t)[0]) if with_strs else [b"null"]
    parts.append(b"}")
    return b"".join(parts)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    state.resolve_model(body.model)
    tokens = body.tokens
    content = await state.cpu_pool.run(_detokenize_json, state, tokens) if len(tokens) > INLINE_CHARS \
        else _detokenize_json(state, tokens)
    return Response(content, media_type="application/json")


def _detokenize_json(state: ServerState, tokens: list[int]) -> bytes:
    """/detokenize's answer as JSON bytes; 400 naming the first id outside the vocabulary."""
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is out of range [0, {vocab})", param="tokens")
    text = state.tokenizer.decode(tokens)
    return json.dumps({"prompt": text}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
