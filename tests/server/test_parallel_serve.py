"""``flashtier serve --tensor-parallel-size 2`` as a real process (two gloo rank processes behind it).

Claims:
- through the openai SDK (chat, and completions with token-id prompts, greedy and seeded sampling), the
  TP 2 server answers exactly what a single-process server answers: the same tokens and the same text.
- SIGKILL of one rank process: ``/health`` turns 503 within a few seconds, the request in flight at that
  moment and a new one get a 503 in the API's error shape (no hang, no traceback), the other rank is
  stopped, and SIGTERM ends the server through its graceful shutdown within the drain timeout.
- start-up errors of the parallel settings are one line and exit status 2 (before any model loads).

Both servers serve the float64 demo model (each writes its own demo checkpoint, same seed) with the SSD
tier off, and start at the same time. Every process runs torch on one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from flashtier.server.cli import main

from ..deploy.serve_process import ServeProcess

COMMON = ("--dtype", "float64", "--no-kv-persist", "--block-size", "16", "--num-blocks", "128",
          "--max-num-batched-tokens", "256", "--drain-timeout", "5", "--log-level", "info")
PROMPT = [(1000 + 37 * i) % 120000 for i in range(29)]
START_TIMEOUT_S = 240


class Serve(ServeProcess):
    """One ``flashtier serve`` subprocess with the common settings, not waited for (two start side by side)."""

    def __init__(self, cache_dir: Path, *args: str) -> None:
        super().__init__(cache_dir, *COMMON, *args, timeout_s=START_TIMEOUT_S, wait=False)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> "Serve":
        super().wait_healthy(timeout_s)
        return self

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def rank_pids(self) -> list[int]:
        """The spawned rank processes: this server's children started by multiprocessing's spawn (not its
        resource tracker)."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                if b"spawn_main" in cmdline:
                    pids.append(int(child))
        return sorted(pids)


def answers(server: Serve) -> list:
    client = server.openai()
    chat = client.chat.completions.create(model="flashtier-tiny", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hello there, ranks!"}],
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    out = [chat.choices[0].message.content, chat.model_extra.get("prompt_token_ids"),
           chat.choices[0].model_extra.get("token_ids")]
    for temperature, seed in ((0.0, None), (1.0, 3)):
        c = client.completions.create(model="flashtier-tiny", prompt=PROMPT, max_tokens=5, temperature=temperature,
                                      seed=seed, extra_body={"ignore_eos": True, "return_token_ids": True})
        out += [c.choices[0].text, c.choices[0].model_extra["token_ids"]]
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_tp2_server_answers_like_one_process_and_fails_cleanly(tmp_path):
    single = Serve(tmp_path / "single")
    tp = Serve(tmp_path / "tp2", "--tensor-parallel-size", "2")
    try:
        single.wait_healthy()
        tp.wait_healthy()
        want, got = answers(single), answers(tp)
        assert got == want
        assert want[2] and len(want[4]) == 5 and want[4] != want[6]  # real tokens; sampling differs from greedy
        assert "tensor parallel 2" in tp.log() and "SSD tier: off with --tensor-parallel-size 2" in tp.log()
        single.stop()

        ranks = tp.rank_pids()
        assert len(ranks) == 2, ranks
        in_flight: dict = {}

        def long_request():
            r = httpx.post(tp.url + "/v1/completions", timeout=120, json={
                "model": "flashtier-tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
            in_flight.update(status=r.status_code, body=r.json())

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(1.5)
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        while tp.health() != 503 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert tp.health() == 503, "/health did not turn 503 within 10 s of a rank's death"
        print(f"/health 503 after {time.monotonic() - t0:.2f} s")
        worker.join(30)
        assert not worker.is_alive(), "the in-flight request hangs"
        assert in_flight["status"] == 503 and set(in_flight["body"]["error"]) >= {"message", "type", "code"}
        r = httpx.post(tp.url + "/v1/completions", timeout=30, json={"model": "flashtier-tiny", "prompt": "x"})
        assert r.status_code == 503 and "Traceback" not in r.text, r.text
        assert r.json()["error"]["message"]
        t0 = time.monotonic()
        while _alive(ranks[0]) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not _alive(ranks[0]), "the surviving rank was not stopped"

        t0 = time.monotonic()
        tp.proc.send_signal(signal.SIGTERM)
        assert tp.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its exit
        assert time.monotonic() - t0 < 5 + 10  # the drain timeout, plus the ranks' reaping
        log = tp.log()
        assert "exited with signal SIGKILL" in log and "Application shutdown complete" in log
        assert "Traceback" not in log
    finally:
        single.stop()
        tp.stop()


@pytest.mark.parametrize(("argv", "line"), [
    (["--tensor-parallel-size", "3"], "flashtier: error: --tensor-parallel-size 3: tiny cannot be split over 3 "
                                      "ranks (--tensor-parallel-size 3 does not divide the 4 attention heads)"),
    (["-tp", "2", "--speculative", "2"], "flashtier: error: --speculative 2: cannot run with "
                                         "--tensor-parallel-size 2"),
    (["-tp", "2", "--device", "cuda:1"], "flashtier: error: --device cuda:1: "),
])
def test_bad_parallel_settings_stop_with_one_line(argv, line, tmp_path, capsys):
    code = main(["serve", "--cache-dir", str(tmp_path), "--no-kv-persist", *argv],
                engine_factory=lambda s: pytest.fail("no engine may be built"))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
