"""The ITL accounting of benchmarks/server_itl_bench.py (benchmarks/_stream_itl.py) against hand-built timelines,
the /metrics reading against the server's real registry, and the prompts' exact token length.

The timeline: 3 streams, one engine step per chunk. Steps 0-2 are slow mixed steps (0.5 s: stream i's prefill
gives its first token at step i), step 3 is the first full decode step (0.9 s: a graph capture), then 0.1 s
decode steps. Each stream gets 8 tokens (steps i .. i+7). The steady window runs from step 3's end (the last
stream's second chunk) to step 7's end (the first stream's last chunk): gaps (3,4) .. (6,7) of every stream,
4 x 3 = 12 samples of exactly 0.1 s. Counting any ramp, capture or first-chunk gap changes the count and the max.
"""

import pytest

from _stream_itl import histogram_sum_count, quantile, steady_itl, summary_ms

STEP_S = [0.5, 0.5, 0.5, 0.9] + [0.1] * 8


def step_ends() -> list[float]:
    ends, t = [], 0.0
    for d in STEP_S:
        t += d
        ends.append(t)
    return ends


def streams(tokens: int = 8, n: int = 3) -> list[list[tuple[float, int]]]:
    ends = step_ends()
    return [[(ends[k], 1) for k in range(i, i + tokens)] for i in range(n)]


def test_steady_window_leaves_out_ramp_capture_and_first_chunks():
    itl = steady_itl(streams())
    ends = step_ends()
    assert len(itl["samples"]) == 12
    assert max(itl["samples"]) == pytest.approx(0.1) and min(itl["samples"]) == pytest.approx(0.1)
    assert itl["window_s"] == pytest.approx(ends[7] - ends[3])
    assert itl["tokens_in_window"] == 12 and itl["multi_token_chunks"] == 0


def test_a_slow_step_inside_the_window_is_counted():
    """The window is not a filter on values: a 0.35 s gap inside it shows in every stream's samples."""
    s = streams()
    late = 0.25
    s = [[(t + late, n) if t > step_ends()[5] else (t, n) for t, n in c] for c in s]  # step 6 took 0.35 s
    gaps = steady_itl(s)["samples"]
    assert len(gaps) == 12
    assert sorted(gaps)[-3:] == pytest.approx([0.35] * 3)


def test_first_chunk_never_starts_a_sample():
    """One stream only: the window opens at its second chunk, so its first gap (TTFT to token 2) is out."""
    chunks = [(0.0, 1), (5.0, 1), (5.1, 1), (5.2, 1)]
    assert steady_itl([chunks])["samples"] == pytest.approx([0.1, 0.1])
    # the first two chunks read at the same instant (one TCP segment): still no sample from the first
    assert steady_itl([[(5.0, 1), (5.0, 1), (5.1, 1)]])["samples"] == pytest.approx([0.1])


def test_multi_token_chunks_and_short_streams():
    s = streams()
    t, _ = s[1][5]
    s[1][5] = (t, 3)  # a step that carried 3 tokens (speculative decoding)
    s.append([(0.0, 1)])  # a stream that never got past its first token does not close the window
    s.append([])
    itl = steady_itl(s)
    assert len(itl["samples"]) == 12
    assert itl["tokens_in_window"] == 14 and itl["multi_token_chunks"] == 1


def test_no_streams():
    assert steady_itl([[], [(1.0, 1)]]) == {"samples": [], "window_s": 0.0, "tokens_in_window": 0,
                                            "multi_token_chunks": 0}
    assert summary_ms([]) == {"itl_ms": None, "itl_p90_ms": None, "itl_mean_ms": None, "itl_samples": 0}


@pytest.mark.parametrize("xs,q,want", [
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5), ([1.0, 2.0, 3.0, 4.0], 0.9, 3.7), ([4.0, 1.0, 3.0, 2.0], 0.0, 1.0),
    ([4.0, 1.0, 3.0, 2.0], 1.0, 4.0), ([7.0], 0.9, 7.0), ([], 0.5, None)], ids=["median", "p90", "min", "max",
                                                                                  "one", "empty"])
def test_quantile(xs, q, want):
    assert quantile(xs, q) == (None if want is None else pytest.approx(want))


def test_quantile_rejects_q_outside_0_1():
    with pytest.raises(ValueError, match="q must be in"):
        quantile([1.0], 1.5)


def test_summary_ms():
    assert summary_ms([0.010, 0.020, 0.030]) == {"itl_ms": 20.0, "itl_p90_ms": 28.0, "itl_mean_ms": 20.0,
                                                 "itl_samples": 3}


def test_histogram_from_the_server_registry():
    """The server's own exposition: observations in, the same sum and count out (other series ignored)."""
    from prometheus_client import generate_latest

    from flashtier.server.serving.metrics import ITL, ServerMetrics

    m = ServerMetrics("flashtier-tiny")
    for v in (0.010, 0.020, 0.045):
        m.itl.observe(v)
        m.ttft.observe(9.0)
    text = generate_latest(m.registry).decode()
    total, count = histogram_sum_count(text, ITL)
    assert count == 3 and total == pytest.approx(0.075)


def test_histogram_text_edge_cases():
    name = "x_itl_seconds"
    text = "\n".join([
        "# HELP x_itl_seconds_sum not a sample", f'{name}_bucket{{le="0.1"}} 50', f'{name}_sum{{m="a b}}"}} 1.5',
        f'{name}_sum{{m="c"}} 2.0 1700000000000', f"{name}_count 4", f"{name}_sum_other 99",
        f'{name}_count{{m="c"}} 3'])
    assert histogram_sum_count(text, name) == (3.5, 7.0)
    assert histogram_sum_count("", name) == (0.0, 0.0)


def test_prompts_render_to_exact_lengths():
    """The bench's prompts: each one exactly --prompt ids of the chat template, all distinct; too short fails."""
    from server_itl_bench import make_prompts

    from flashtier.server.text.chat_encoding import encode_to_ids
    from flashtier.server.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(None)
    for length in (16, 33):
        prompts = make_prompts(3, length)
        assert [len(ids) for _, ids in prompts] == [length] * 3
        assert len({tuple(ids) for _, ids in prompts}) == 3
        for text, ids in prompts:
            assert encode_to_ids(tok, [{"role": "user", "content": text}]) == ids
    with pytest.raises(ValueError, match="--prompt 3"):
        make_prompts(1, 3)
