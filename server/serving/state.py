"""What the routes share: ``ServerState`` (settings, tokenizer, metrics, the engine client) and the
mappings common to chat and completions (model name, cache salt, stop strings, sampling parameters,
usage, logprob entries). The request checks are in request_checks.py.

Cache isolation (``--cache-isolation``): the engine puts a request's ``cache_salt`` into the namespace
hash of every tier (HBM prefix cache, SSD, snapshots), so requests share cached KV only when their
salts are equal. ``shared`` passes the client's ``cache_salt`` as it is. ``per-key`` passes
``tenant_salt(api_key, cache_salt)``: ``sha256("flashtier/tenant/v1" NUL key)`` in hex, NUL, then the
client's salt (or nothing), so a salt only separates requests within one key, and no salt a client
sends can reach another key's entries (the hex part comes from the key the auth middleware checked,
never from the body). Without --api-key no request has a checked key: all are one tenant, as in shared.
The derivation is stable across restarts, so SSD entries stay reachable for their key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request

from flashtier.engine.client import EngineClient
from flashtier.engine.grammar.constraint import OutputConstraint
from flashtier.engine.core.outputs import CacheUsage, ResumeInfo, TokenLogprob
from flashtier.engine.sample.params import SamplingParams
from flashtier.server.http.auth import authenticated_key
from flashtier.server.http.errors import BadRequest, NotFound, ServiceUnavailable, ShuttingDown
from flashtier.server.http.frontend_pool import INLINE_CHARS, FrontendPool
from flashtier.server.grammar.service import GrammarService
from flashtier.server.serving.drain import Drain
from flashtier.server.serving.metrics import ServerMetrics
from flashtier.server.protocol.request_models import SamplingFields
from flashtier.server.response_store.store import ResponseStore
from flashtier.server.config.settings import ServerSettings
from flashtier.server.text.token_texts import TokenTexts
from flashtier.server.text.tokenizer import THINK_END, Tokenizer

# Logprobs are clamped to this so that JSON never carries -Infinity.
MIN_LOGPROB = -9999.0
# Prompts larger than this (characters) are encoded on the frontend pool, off the event loop.
THREAD_ENCODE_CHARS = INLINE_CHARS
TENANT_DOMAIN = b"flashtier/tenant/v1\x00"


class ServerState:
    """Per-app state, at ``app.state.flashtier``; ``engine`` is set by the lifespan once it is built."""

    def __init__(self, settings: ServerSettings, tokenizer: Tokenizer, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.engine: EngineClient | None = None
        # the start-up phase /health names until the engine is ready: loading -> warming up -> ready (or failed);
        # written by the app's lifespan (loader thread and event loop), read anywhere (a str: atomic)
        self.phase = "loading"
        self.ready = threading.Event()  # set once the engine serves (tests wait on it; never a sleep)
        self.token_texts = TokenTexts(tokenizer)
        self.created = int(time.time())
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.grammars = GrammarService(tokenizer)
        self.response_store: ResponseStore | None = None  # built by create_app (responses/store.py)
        self.cpu_pool = FrontendPool(settings.frontend_workers)  # shut down by the app's lifespan
        self.drain = Drain()  # the in-flight generations; SIGTERM drains them (drain.py)

    def require_engine(self) -> EngineClient:
        """The engine for a new request (and /health): 503 ``shutting_down`` once the drain began, 503
        ``not_ready`` while it loads or after it stopped."""
        if self.drain.draining:
            raise ShuttingDown()
        engine = self.engine
        if engine is None:
            raise ServiceUnavailable(f"the engine is {self.phase}; retry later")
        if not engine_ready(engine):
            raise ServiceUnavailable("the engine is not ready (loading or stopped); retry later")
        return engine

    def resolve_model(self, name: str | None) -> str:
        names = self.settings.model_names
        if name is None or name == "":
            return names[0]
        if name in names:
            return name
        raise NotFound(f"the model {name!r} does not exist; this server serves {list(names)}", param="model",
                       code="model_not_found")

    def cache_salt(self, request: Request, client_salt: str | None) -> str | None:
        """The salt the engine gets for a request sending `client_salt` (see the module doc)."""
        if self.settings.cache_isolation != "per-key":
            return client_salt
        key = authenticated_key(request.scope)
        return client_salt if key is None else tenant_salt(key, client_salt)

    @property
    def max_model_len(self) -> int | None:
        if self.engine is not None:
            try:
                return self.engine.max_model_len
            except Exception:
                return self.settings.max_model_len
        return self.settings.max_model_len


def tenant_salt(api_key: str, client_salt: str | None) -> str:
    """``sha256(TENANT_DOMAIN + key)`` hex, NUL, the client's salt: the key's tenant, then the salt within it."""
    tenant = hashlib.sha256(TENANT_DOMAIN + api_key.encode("utf-8")).hexdigest()
    return f"{tenant}\x00{client_salt or ''}"


def get_state(request: Request) -> ServerState:
    return request.app.state.flashtier


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def build_sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None,
                          constraint: OutputConstraint | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            constraint=constraint,
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def chat_logprob_entry(texts: TokenTexts, lp: TokenLogprob, top: int) -> dict[str, Any]:
    text, raw = texts.get(lp.token_id)
    alternatives = []
    for token_id, value in lp.top[:top]:
        alt_text, alt_raw = texts.get(token_id)
        alternatives.append({"token": alt_text, "logprob": clamp_logprob(value), "bytes": alt_raw})
    return {"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": raw, "top_logprobs": alternatives}


def engine_ready(engine: EngineClient) -> bool:
    """``engine.is_ready()``, False when asking fails (a dead engine thread must not raise here)."""
    try:
        return engine.is_ready()
    except Exception:  # noqa: BLE001
        return False


def usage_dict(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int,
               cache: CacheUsage, resume: ResumeInfo) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cache.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "flashtier": {
            "cached_tokens_by_tier": {"hbm": cache.hbm_tokens, "ssd": cache.ssd_tokens,
                                      "snapshot": cache.snapshot_tokens},
            "decoder_tokens": cache.decoder_tokens,
            "approximate_replay_tokens": cache.approximate_replay_tokens,
            "computed_tokens": cache.computed_tokens,
            "persisted_bytes": cache.persisted_bytes,
            "resume": {"kind": resume.kind, "replay_from": resume.replay_from,
                       "approximate": resume.kind == "replay"},
        },
    }


def merge_resume(resumes: Sequence[ResumeInfo]) -> ResumeInfo:
    """One provenance for several prompts: any replay makes the response approximate (from the
    earliest R), else any exact resume, else cold."""
    replays = [r.replay_from for r in resumes if r.kind == "replay" and r.replay_from is not None]
    if replays:
        return ResumeInfo("replay", min(replays))
    return ResumeInfo("exact") if any(r.kind == "exact" for r in resumes) else ResumeInfo("cold")


def sum_cache(caches: Sequence[CacheUsage]) -> CacheUsage:
    names = [f.name for f in dataclasses.fields(CacheUsage)]
    return CacheUsage(**{name: sum(getattr(c, name) for c in caches) for name in names})
