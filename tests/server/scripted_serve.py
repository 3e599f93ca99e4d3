"""``flashtier serve`` in front of a ScriptedEngineClient, as a process: the API without a model.

    python tests/server/scripted_serve.py [--scripted-hold-after K] [--scripted-fail MESSAGE] [serve flags...]
                                                      (by path: scripted_engine.py is its neighbour)

It runs the server's own entry point (``flashtier.server.cli.main``) with an engine factory, so
settings, logging, the demo note, uvicorn and the SIGTERM drain are the product's; only the engine
client is the test double. Each request gets 64 "tick N." tokens, 20 ms apart. The ``--scripted-*`` flags
(taken off before ``serve`` parses the rest): ``--scripted-hold-after K`` holds every request after its K-th
output until the server stops it, logging ``scripted engine: holding <request id>`` (INFO) as it starts to;
``--scripted-fail MESSAGE`` makes the factory raise ``RuntimeError(MESSAGE)``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from flashtier.engine.client import EngineClient
from flashtier.server.cli import main
from flashtier.server.config.settings import ServerSettings
from flashtier.server.text.tokenizer import Tokenizer
from scripted_engine import ScriptedEngineClient  # run by path: its folder is sys.path[0]

logger = logging.getLogger("scripted_engine")


def scripted_engine(settings: ServerSettings, hold_after: int | None = None) -> EngineClient:
    tok = Tokenizer.from_model_dir(settings.model_dir)
    reply = tok.encode(" ".join(f"tick {i}." for i in range(1, 65)), allow_special=False)
    engine = ScriptedEngineClient(reply + [tok.eos_id], eos_token_id=tok.eos_id, step_delay_s=0.02,
                                  max_model_len=settings.max_model_len or 8192, vocab_size=tok.vocab_size,
                                  hold_after=hold_after)
    engine.on_hold = lambda request_id: logger.info("scripted engine: holding %s", request_id)
    return engine


def failing_engine(message: str):
    def factory(settings: ServerSettings) -> EngineClient:
        raise RuntimeError(message)
    return factory


if __name__ == "__main__":
    scripted = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scripted.add_argument("--scripted-hold-after", type=int, default=None)
    scripted.add_argument("--scripted-fail", default=None)
    ours, serve_args = scripted.parse_known_args(sys.argv[1:])
    if ours.scripted_fail is not None:
        factory = failing_engine(ours.scripted_fail)
    else:
        def factory(settings: ServerSettings) -> EngineClient:
            return scripted_engine(settings, ours.scripted_hold_after)
    sys.exit(main(["serve", *serve_args], engine_factory=factory))
