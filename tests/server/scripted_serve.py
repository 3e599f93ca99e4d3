"""``flashtier serve`` in front of a ScriptedEngineClient, as a process: the API without a model.

    python tests/server/scripted_serve.py [serve flags...]     (by path: scripted_engine.py is its neighbour)

It runs the server's own entry point (``flashtier.server.cli.main``) with an engine factory, so
settings, logging, the demo note, uvicorn and the SIGTERM drain are the product's; only the engine
client is the test double. Each request gets 64 "tick N." tokens, 20 ms apart.
"""

from __future__ import annotations

import sys

from flashtier.engine.client import EngineClient
from flashtier.server.cli import main
from flashtier.server.config.settings import ServerSettings
from flashtier.server.text.tokenizer import Tokenizer
from scripted_engine import ScriptedEngineClient  # run by path: its folder is sys.path[0]


def scripted_engine(settings: ServerSettings) -> EngineClient:
    tok = Tokenizer.from_model_dir(settings.model_dir)
    reply = tok.encode(" ".join(f"tick {i}." for i in range(1, 65)), allow_special=False)
    return ScriptedEngineClient(reply + [tok.eos_id], eos_token_id=tok.eos_id, step_delay_s=0.02,
                                max_model_len=settings.max_model_len or 8192, vocab_size=tok.vocab_size)


if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]], engine_factory=scripted_engine))
