"""What a vLLM user expects: --version and /version, vLLM's flag names, CORS, X-Request-Id, a default output
cap, request fields that cannot be honoured refused, chat return_token_ids, per-route body limits, one
server per --kv-dir, and the start-up summary."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from flashtier import __version__
from flashtier.server.cli import _serve_seed, build_parser, main
from flashtier.server.config.kv_dir_lock import KVDirInUse, KVDirLock, held_by
from flashtier.server.protocol.response_models import ChatCompletionChunk, ChatCompletionResponse
from flashtier.server.serving.request_checks import resolve_max_tokens
from flashtier.server.config.settings import build_settings
from flashtier.server.config.startup_log import mask_url, startup_lines

from .conftest import MAX_MODEL_LEN, run_server
from .scripted_engine import SCRIPTED_SERVE_ARGV

USER = [{"role": "user", "content": "hi"}]


def _ns(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_version_flag_and_route(server):
    for argv in (["--version"], ["serve", "--version"]):
        proc = subprocess.run([sys.executable, "-m", "flashtier.server.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{__version__}\n", "")
    with server.http() as http:
        assert http.get("/version").json() == {"version": __version__}


def test_vllm_flags_set_our_settings(tmp_path):
    s = build_settings(_ns("--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "m",
                           "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                           "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "100",
                           "--no-enable-prefix-caching", "--dtype", "float", "--seed", "3", "--tensor-parallel-size",
                           "1", "--trust-remote-code", "--allowed-origins",
                           '["https://a.example", "https://b.example"]'),
                       {})
    assert (s.host, s.port, s.api_key, s.served_model_name, s.max_model_len) == ("0.0.0.0", 9001, ("k",), ("m",), 4096)
    kv = s.kvstore
    assert (kv.hbm_utilization, kv.num_blocks, kv.enable_prefix_caching) == (0.5, 100, False)
    assert (s.dtype, s.seed, s.allowed_origins) == ("float32", 3, ("https://a.example", "https://b.example"))
    cfg = s.engine_config()
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.dtype) == (8, 256, 4096, "float32")
    assert build_settings(_ns("--enable-prefix-caching", "-tp", "1"), {}).kvstore.enable_prefix_caching
    assert cfg.cuda_graphs and not build_settings(_ns("--enforce-eager"), {}).engine_config().cuda_graphs
    assert build_settings(_ns(), {"FLASHTIER_ALLOWED_ORIGINS": '["*"]'}).allowed_origins == ("*",)
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())  # noqa: SLF001
    for flag in ("--gpu-memory-utilization", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "-tp",
                 "--trust-remote-code", "--enforce-eager", "--max-tokens-default", "--max-tokenize-bytes", "--frontend-workers"):
        assert flag in help_text, flag
    assert "prefix reuse: on by default; --no-prefix-caching" in help_text and "turns the HBM prefix cache off" in help_text


@pytest.mark.parametrize(("argv", "line"), [
    (["--data-parallel-size", "2"], "flashtier: error: --data-parallel-size/-dp: 2 is not supported: data parallel "
                                    "serving is not implemented; split the model with --tensor-parallel-size"),
    (["-tp", "0"], "flashtier: error: --tensor-parallel-size/-tp: must be a positive integer, got 0"),
    (["--dtype", "half"], "flashtier: error: --dtype: 'half' is not supported (no float16 kernels)"),
    (["--gpu-memory-utilization", "1.5"], "flashtier: error: --hbm-utilization/--gpu-memory-utilization: must be in"),
])
def test_unsupported_vllm_values_stop_with_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv], engine_factory=lambda s: pytest.fail("no engine may be built"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_seed_seeds_the_default_generators():
    _serve_seed(build_settings(_ns("--seed", "5"), {}))
    first = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(first, torch.rand(3))
    before = torch.get_rng_state()
    _serve_seed(build_settings(_ns(), {}))  # no --seed: the generators are left as they are
    assert torch.equal(before, torch.get_rng_state())


def test_cors_only_with_allowed_origins(tokenizer):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with run_server(tokenizer, api_key=("k",), allowed_origins=("https://app.example",)) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    with run_server(tokenizer) as srv:  # default: no CORS at all
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_echoed_and_logged(server, caplog):
    caplog.set_level(logging.INFO, logger="flashtier.server.http.request_id")
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": USER}, headers={"X-Request-Id": "client-7"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "client-7"
        assert f"request {r.json()['id']}: X-Request-Id client-7" in caplog.text
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True},
                         headers={"X-Request-Id": "client-8"}) as s:
            assert s.headers["x-request-id"] == "client-8"
            s.read()
        r = http.post("/v1/completions", json={"prompt": "x", "n": 0}, headers={"X-Request-Id": "client-9"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "client-9"  # errors too
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.headers["x-request-id"] == r.json()["id"]  # without the header: the server's id
        r = http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "x" * 200})
        assert r.headers["x-request-id"] == r.json()["id"]  # an unusable one is ignored


def test_max_tokens_default_caps_a_request_without_one(tokenizer):
    assert resolve_max_tokens(10, None, 100, prompt_param="p", tokens_param="t", default=32) == 32
    assert resolve_max_tokens(90, None, 100, prompt_param="p", tokens_param="t", default=32) == 10
    assert resolve_max_tokens(10, None, 100, prompt_param="p", tokens_param="t", default=0) == 90
    assert resolve_max_tokens(10, 50, 100, prompt_param="p", tokens_param="t", default=32) == 50
    with run_server(tokenizer, max_tokens_default=7) as srv, srv.http() as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": None}).status_code == 200
        assert srv.engine.calls[-1].params.max_tokens == 7
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
        assert srv.engine.calls[-1].params.max_tokens == 3
    with run_server(tokenizer, max_tokens_default=0) as srv, srv.http() as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": None}).status_code == 200
        call = srv.engine.calls[-1]
        assert call.params.max_tokens == MAX_MODEL_LEN - len(call.prompt_token_ids)


def test_max_tokens_default_applies_to_chat(tokenizer):
    with run_server(tokenizer, max_tokens_default=7) as srv, srv.http() as http:
        assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).status_code == 200
        assert srv.engine.calls[-1].params.max_tokens == 3
        assert http.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
        assert srv.engine.calls[-1].params.max_tokens == 7


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "prompt_logprobs", 1),
    ("/v1/completions", "prompt_logprobs", 0),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "truncate_prompt_tokens", 100),
    ("/v1/completions", "bad_words", ["x"]),
    ("/v1/chat/completions", "allowed_token_ids", [1, 2]),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
])
def test_fields_that_would_change_the_answer_are_refused(server, path, field, value):
    base = {"messages": USER} if "chat" in path else {"prompt": "x"}
    with server.http() as http:
        r = http.post(path, json={**base, field: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and f"{field} is not supported" in err["message"]
        neutral = {"bad_words": [], "use_beam_search": False, "echo": False}.get(field)
        assert http.post(path, json={**base, field: neutral}).status_code == 200
    assert len(server.engine.calls) == 1  # only the neutral request reached the engine


def test_completions_echo_stays_supported(server):
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "Say", "echo": True, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Say")


def test_chat_return_token_ids(server):
    body = {"messages": USER, "return_token_ids": True}
    with server.http() as http:
        answer = http.post("/v1/chat/completions", json=body).json()
        call = server.engine.calls[-1]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        plain = http.post("/v1/chat/completions", json={"messages": USER}).json()
    assert answer["prompt_token_ids"] == list(call.prompt_token_ids)
    (choice,) = answer["choices"]
    assert choice["token_ids"] and server.tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == \
        choice["message"]["content"]
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    # the documented response schemas (additional properties forbidden) hold the extension's fields
    ChatCompletionResponse.model_validate(answer)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)


def test_tokenize_has_its_own_body_limit(tokenizer):
    text = "word " * 1000  # a ~5 KB body
    with run_server(tokenizer, max_tokenize_bytes=2048, max_request_bytes=1 << 20) as srv, srv.http() as http:
        for path, body in (("/tokenize", {"prompt": text}), ("/detokenize", {"tokens": [1] * 2000})):
            r = http.post(path, json=body)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", path
            assert "2048 bytes" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": text}]}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/tokenize", json={"prompt": "short"}).status_code == 200


def test_kv_dir_lock_in_process(tmp_path):
    lock = KVDirLock.acquire(tmp_path)
    try:
        assert (tmp_path / "SERVER.LOCK").read_text() == f"{os.getpid()}\n"
        with pytest.raises(KVDirInUse) as info:
            KVDirLock.acquire(tmp_path)  # another open file description: flock refuses it, as for a process
        assert str(info.value) == (f"--kv-dir {tmp_path} is in use by another flashtier process (pid {os.getpid()}); "
                                   "pass --kv-dir to use another directory")
        assert held_by(tmp_path) == os.getpid()
    finally:
        lock.release()
    assert held_by(tmp_path) is None
    KVDirLock.acquire(tmp_path).release()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_second_demo_server_on_the_same_cache_dir_stops(tmp_path):
    """Two demo servers share CACHE_DIR/kv/demo-tiny: the second stops at once, naming the first's pid."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHTIER_")}
    env.update(FLASHTIER_CACHE_DIR=str(tmp_path / "cache"))
    port = _free_port()
    first = subprocess.Popen([*SCRIPTED_SERVE_ARGV, "--port", str(port)], cwd=tmp_path,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert first.poll() is None, "the first server died"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "flashtier.server.cli", "serve", "--port", str(_free_port())],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        first.terminate()
        first.wait(30)
    kv_dir = tmp_path / "cache" / "kv" / "demo-tiny"
    assert second.returncode == 2 and not second.stdout
    assert second.stderr == (f"flashtier: error: --kv-dir {kv_dir} is in use by another flashtier process "
                             f"(pid {first.pid}); pass --kv-dir to use another directory\n")
    assert not (tmp_path / "cache" / "models").exists()  # it stopped before writing the demo checkpoint
    assert kv_dir.stat().st_mode & 0o777 == 0o700  # created private, as the SSD store wants it (no warning)


def test_startup_summary(tmp_path):
    s = build_settings(_ns("--kv-dir", str(tmp_path), "--kv-disk-budget", "2T", "--kv-lifetime", "72h", "--redis-url",
                           "redis://user:s3cret@10.0.0.5:6379/0", "--snapshot-ttl", "5m", "--host", "0.0.0.0",
                           "--api-key", "k", "--device", "cpu"), {})
    summary = "engine: device cpu, dtype float32, HBM pool 1,000 blocks of 64 tokens x 4,096 B = 0.00 GiB"
    lines = startup_lines(s, SimpleNamespace(engine_summary=lambda: summary))  # the engine-core client's line
    assert lines[0].startswith("demo model: ")
    assert lines[1] == summary
    assert lines[2] == f"SSD tier: {tmp_path} (budget 2T, lifetime 72h)"
    assert lines[3] == "snapshot pool: redis://user:***@10.0.0.5:6379/0, TTL 5m" and "s3cret" not in " ".join(lines)
    assert lines[4] == "API: http://0.0.0.0:8000/v1 (API key required)"
    off = startup_lines(build_settings(_ns("--no-kv-persist", "--device", "cpu"), {}), object())
    assert off[2] == "SSD tier: off (--no-kv-persist)" and off[3].startswith("snapshot pool: embedded")
    assert off[1] == "engine: device cpu, dtype float32, HBM pool not reported by object"
    assert mask_url("redis://:pw@h:1/0?password=pw2") == "redis://:***@h:1/0?password=***"
