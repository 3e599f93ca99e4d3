"""benchmarks/serve_load.py: its figures (_load_metrics.py) against a hand-built timeline, its traffic, and one run
against a real tiny CPU server whose JSON must have the documented structure and hold every invariant.

The hand timeline (seconds from the run's start; four requests, max_tokens 4):

    A  arrives 0.0, sent 0.0, token chunks 0.5 0.6 0.7 0.8, ends 0.9   TTFT 0.5  gaps .1 .1 .1  TPOT 0.4/3
    B  arrives 0.2, sent 0.3, token chunks 1.3 1.4 1.9 2.0, ends 2.0   TTFT 1.0  gaps .1 .5 .1  TPOT 0.7/3
    C  arrives 0.4, sent 0.4, HTTP 429 at 0.45
    D  arrives 1.0, sent 1.0, token chunks 1.2 1.3 (2 tokens, stopped), ends 1.4   TTFT 0.2  gap .1  TPOT 0.2

duration 2.0 s (B's end): 3 completed -> 1.5 req/s, 10 tokens -> 5 tok/s. SLO TTFT <= 800 ms and longest gap
<= 300 ms: A and D meet it, B fails both (TTFT 1.0 s, its 0.5 s stall) -> goodput 1.0 req/s.
"""

from __future__ import annotations

import copy
import json
import math
import random

import pytest

from _load_metrics import RequestRecord, Slo, check_result, stats_ms, summarize
from serve_load import Workload, arrivals, conversation, main, parse_rates, system_prompt


def hand_records() -> list[RequestRecord]:
    a = RequestRecord(0, 0, 0.0, 0.0, 0.9, [0.5, 0.6, 0.7, 0.8], 4, 100, 0, "length")
    b = RequestRecord(1, 0, 0.2, 0.3, 2.0, [1.3, 1.4, 1.9, 2.0], 4, 100, 64, "length")
    c = RequestRecord(0, 1, 0.4, 0.4, 0.45, error="http_429", error_detail="queue full")
    d = RequestRecord(1, 1, 1.0, 1.0, 1.4, [1.2, 1.3], 2, 200, 100, "stop")
    return [a, b, c, d]


def test_summarize_hand_timeline():
    row = summarize(hand_records(), Slo(ttft_ms=800, itl_ms=300), max_tokens=4)
    assert (row["requests"], row["completed"], row["failed"], row["errors"]) == (4, 3, 1, {"http_429": 1})
    assert row["duration_s"] == 2.0 and row["request_throughput"] == 1.5 and row["output_throughput"] == 5.0
    assert (row["good"], row["goodput"]) == (2, 1.0)
    assert row["ttft_ms"] == stats_ms([0.5, 1.0, 0.2]) and row["ttft_ms"]["p50"] == 500.0
    assert row["itl_ms"]["n"] == 7 and row["itl_ms"]["p50"] == 100.0 and row["itl_ms"]["p99"] == pytest.approx(
        100.0 + 0.94 * 400.0)  # 7 gaps: six of 0.1 s, one of 0.5 s; p99 between the last two order statistics
    assert [round(x, 3) for x in sorted(
        [r["ttft_ms"] for r in row["per_request"] if r["ttft_ms"] is not None])] == [200.0, 500.0, 1000.0]
    assert row["tpot_ms"]["n"] == 3 and row["tpot_ms"]["p50"] == pytest.approx(200.0)  # of 133.3, 200, 233.3
    assert row["tpot_ms"]["mean"] == pytest.approx((0.4 / 3 + 0.7 / 3 + 0.2) / 3 * 1e3, abs=1e-3)
    # waits 0, 0.1, 0, 0 (C failed but waited too): p99 of the sorted [0, 0, 0, 0.1] is 0.97 of the way to 0.1 s
    assert row["e2el_ms"]["p50"] == pytest.approx(900.0) and row["wait_ms"]["p99"] == pytest.approx(97.0)
    assert row["short_outputs"] == 1 and row["finish_reasons"] == {"length": 2, "stop": 1}
    assert (row["prompt_tokens"], row["cached_tokens"], row["cached_share"]) == (400, 164, 0.41)
    assert [t["cached_tokens"] for t in row["turns"]] == [64, 100] and row["turns"][1]["completed"] == 1
    assert row["mean_in_flight"] == pytest.approx((0.9 + 1.7 + 0.4) / 2.0)
    assert check_result({"rows": [{"rate": "x", **row}]}) == []


@pytest.mark.parametrize("slo,good", [(Slo(), None), (Slo(ttft_ms=1000), 3), (Slo(ttft_ms=999.9), 2),
                                      (Slo(itl_ms=500), 3), (Slo(itl_ms=499.9), 2), (Slo(tpot_ms=250), 3),
                                      (Slo(tpot_ms=200), 2), (Slo(tpot_ms=199.9), 1), (Slo(e2el_ms=900), 2),
                                      (Slo(e2el_ms=1700), 3), (Slo(ttft_ms=800, e2el_ms=800), 1)],
                         ids=["none", "ttft-edge", "ttft-below", "itl-edge", "itl-below", "tpot-250", "tpot-edge",
                              "tpot-below", "e2el-edge", "e2el-1700", "all-of-several"])
def test_each_slo_counts_at_its_edge(slo, good):
    """A limit equal to a request's value is met (vLLM's <=); just below it is not. TPOTs: A 133.3 ms, B 233.3 ms,
    D 200 ms. Several SLOs: a request must meet all of them (A's E2E is 900 ms)."""
    row = summarize(hand_records(), slo, max_tokens=4)
    assert row["good"] == good
    assert row["goodput"] == (None if good is None else good / 2.0)


def test_arrivals_are_seeded_poisson():
    times = arrivals(2000, 4.0, random.Random("x"))
    assert times == arrivals(2000, 4.0, random.Random("x")) and times != arrivals(2000, 4.0, random.Random("y"))
    assert times[0] == 0.0 and times == sorted(times)
    # 1999 exponential gaps of mean 0.25 s: their mean is within 0.25 +- 3 standard errors (0.0168) for this seed
    assert abs(times[-1] / 1999 - 0.25) < 0.017
    assert arrivals(5, math.inf, random.Random(0)) == [0.0] * 5


def test_conversations_resend_the_previous_turn_and_share_the_system_prompt():
    w = Workload(sessions=3, turns=4, system_words=50, task_words=8, tool_words=30, output_tokens=4, seed=1,
                 ignore_eos=True, token_ids=True)
    system = system_prompt(w)
    a, b = conversation(w, system, "0.0", 0), conversation(w, system, "1.0", 0)
    assert len(a) == 4 and all(t[0] == {"role": "system", "content": system} for t in a)
    for k in range(1, 4):  # each turn is the previous one plus a tool call and its output
        assert a[k][:len(a[k - 1])] == a[k - 1] and len(a[k]) == len(a[k - 1]) + 2
        assert a[k][-2]["tool_calls"][0]["id"] == a[k][-1]["tool_call_id"]
    assert a[0][1]["content"] != b[0][1]["content"] and a[3][2:] == b[3][2:]  # another rate: same shape, new task
    assert conversation(w, system, "0.0", 0) == a and conversation(w, system, "0.0", 1) != a
    assert json.dumps(a) == json.dumps(conversation(w, system_prompt(w), "0.0", 0))


def test_parse_rates():
    assert parse_rates("0.5, 1,inf") == [0.5, 1.0, math.inf]
    for bad in ("", "0", "-1,2"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


# ---- one run against a real server ---------------------------------------------------------------------------

SERVE = "--device cpu --preset tiny --no-kv-persist --max-num-seqs 4"
RATES = ("2", "4")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("serve_load") / "load.json"
    code = main(["--serve", SERVE, "--threads", "1", "--sessions", "2", "--turns", "2", "--output-tokens", "3",
                 "--system-words", "60", "--task-words", "6", "--tool-words", "20", "--rates", ",".join(RATES),
                 "--slo-ttft-ms", "1e7", "--slo-itl-ms", "1e7", "--ready-timeout", "300", "--request-timeout", "120",
                 "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == 0, (data.get("errors"), data.get("problems"), data.get("server_log_tail"))
    return data


def test_run_against_a_tiny_cpu_server(result):
    assert result["command"].startswith("python3 -P benchmarks/serve_load.py --serve")
    assert result["server"]["preset"] == "tiny" and result["server"]["device"] == "cpu"
    assert result["server"]["card"] == "CPU" and result["server"]["model"] == "flashtier-tiny"
    assert result["serve_command"].startswith("flashtier serve " + SERVE) and result["server_exit"] is not None
    assert result["errors"] == {} and result["problems"] == [] and result["warmup"]["error"] is None
    assert [r["rate"] for r in result["rows"]] == list(RATES) and result["slo_ms"] == {"ttft_ms": 1e7, "itl_ms": 1e7}
    for row in result["rows"]:
        reqs = row["per_request"]
        # counts add up
        assert row["requests"] == len(reqs) == 4 and row["completed"] + row["failed"] == 4
        assert sum(row["errors"].values()) == row["failed"] == 0 and row["short_outputs"] == 0
        assert row["output_tokens"] == 4 * 3 == sum(r["output_tokens"] for r in reqs)
        assert sorted((r["session"], r["turn"]) for r in reqs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        # percentiles ordered, TTFT <= E2E
        for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
            s = row[name]
            assert s["n"] > 0 and s["p50"] <= s["p90"] <= s["p99"], (name, s)
        assert row["itl_ms"]["n"] == 4 * 2  # 3 tokens of one token each: 2 gaps per request
        assert all(0 < r["ttft_ms"] <= r["e2el_ms"] for r in reqs) and row["ttft_ms"]["p99"] <= row["e2el_ms"]["p99"]
        # goodput <= throughput (here equal: SLOs no request can miss)
        assert row["good"] == row["completed"] and row["goodput"] == row["request_throughput"] > 0
        assert row["output_throughput"] == pytest.approx(12 / row["duration_s"], rel=1e-3)
        # cached tokens: every later turn resends its previous turn; the shared system prompt is cached anyway
        later = [r for r in reqs if r["turn"] == 1]
        assert all(r["cached_tokens"] > 0 for r in later) and row["turns"][1]["cached_tokens"] > 0
        assert all(r["cached_tokens"] <= r["prompt_tokens"] for r in reqs)
        assert 0 < row["cached_share"] <= 1 and row["client_cpu_share"] is not None
    assert check_result(result, expect_cached=True) == []


def _break(kind: str, row: dict) -> None:
    req = row["per_request"][-1]
    if kind == "counts":
        row["completed"] -= 1
    elif kind == "errors":
        row["errors"] = {"timeout": 1}
    elif kind == "percentiles":
        row["itl_ms"]["p90"] = row["itl_ms"]["p99"] + 1
    elif kind == "ttft-after-e2e":
        req["ttft_ms"] = req["e2el_ms"] + 1
    elif kind == "goodput":
        row["goodput"] = row["request_throughput"] * 1.01
    elif kind == "no-cache-later-turn":
        req["cached_tokens"] = 0
    elif kind == "sent-before-arrival":
        req["sent_s"] = req["arrival_s"] - 0.01
    elif kind == "output-tokens":
        row["output_tokens"] += 1


@pytest.mark.parametrize("kind,message", [
    ("counts", "completed"), ("errors", "do not add up"), ("percentiles", "itl_ms percentiles out of order"),
    ("ttft-after-e2e", "TTFT"), ("goodput", "above throughput"), ("no-cache-later-turn", "no cached tokens"),
    ("sent-before-arrival", "sent before it arrived"), ("output-tokens", "output_tokens differs")])
def test_check_result_catches_a_broken_result(result, kind, message):
    broken = copy.deepcopy(result)
    _break(kind, broken["rows"][0])
    found = check_result(broken, expect_cached=True)
    assert any(message in line for line in found), found
    assert all(line.startswith(f"rate {RATES[0]}:") for line in found)
