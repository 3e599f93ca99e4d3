"""GET /v1/models, /v1/models/{model}, /health, /metrics; POST /tokenize, /detokenize.

/health is 200 ``{"status": "ok"}`` once the engine accepts requests and 503 before (loading) and
after (stopped). /metrics is the Prometheus text exposition of the app's registry. /tokenize takes
either ``prompt`` (text; control-token text becomes control tokens) or ``messages`` (rendered exactly
as /v1/chat/completions renders them, tools and thinking included), and needs no engine.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flashtier.server.chat_prompt import render_chat
from flashtier.server.errors import BadRequest
from flashtier.server.protocol import DetokenizeRequest, TokenizeRequest
from flashtier.server.protocol_responses import (
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from flashtier.server.request_checks import check_text
from flashtier.server.settings import DEMO_NOTE
from flashtier.server.state import ServerState, get_state

router = APIRouter()


def _cards(state: ServerState) -> list[dict]:
    settings = state.settings
    root = settings.model_dir or f"preset:{settings.effective_preset}"
    ext = {"demo": settings.is_demo, "note": DEMO_NOTE if settings.is_demo else None}
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


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    registry = get_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("send exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        check_text(body.prompt, "prompt")
        ids = state.tokenizer.encode(body.prompt, allow_special=True)
    else:
        assert body.messages is not None
        prompt = await render_chat(state, body.messages, tools=body.tools, tool_choice=None,
                                   reasoning_effort=body.reasoning_effort,
                                   chat_template_kwargs=body.chat_template_kwargs,
                                   add_generation_prompt=body.add_generation_prompt)
        ids = prompt.ids
    strs = [state.token_texts.get(t)[0] for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                         "token_strs": strs})


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    state.resolve_model(body.model)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is out of range [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})
