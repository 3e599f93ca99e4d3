"""CUDA-graph decode steps (engine/runner/decode_graphs.py) against the eager batched forward on CUDA (``-m gpu``).

Two engines on the same tiny model on the GPU run the same requests (prompts of 3..40 tokens, 5 sequences
finishing at different steps, so decode batches of 5 and 3 replay from the 8- and 4-row graphs with pad
rows): one with ``cuda_graphs=False``, one with graphs. The model is in the checkpoint formats (FP8 linears,
MXFP4 routed experts: the kernels a real checkpoint runs) at the real index width (128), so the Triton indexer
runs (the reference indexer checks addresses on the host and cannot be captured, nor can the float experts'
loop: such models run eagerly). Tokens must be identical and logits bit-identical: the graph pads every op
to the bucket's row count, so this holds exactly when every kernel is invariant to the row count (the
batch-invariance promise, over the whole step: a sequence decoded in a batch of 5 padded to 8 gets the bits
it gets unpadded). The graph engine must have replayed (captures > 0, runs > 0). Both Engram placements:
tables on the device (captured gathers) and in pinned host memory (rows gathered on the host and fed before
each replay). A speculative engine (drafter forced to the plain run's continuation, wrong from a varying
position on) replays its verify steps too: its tokens and logits with graphs equal its eager run's, and the
graphs ran verified chunks.
"""

import os

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.engram_offload import tables_to_host_
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .gpu_models import tiny_on_cuda
from .logit_recorder import record_logits
from .spec_harness import force_drafts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"),
]
TOL = 0.0  # bit-identical: measured 14 of 14 steps on the H200, both Engram placements
LENGTHS = [3, 17, 40, 1, 33]


def _engine(model, dtype, graphs):
    cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, forward="batched", dtype=dtype,
                       device="cuda", cuda_graphs=graphs)
    return Engine(model, cfg, KVStoreConfig(block_size=16, num_blocks=400))


def _run(engine, logits):
    record_logits(engine, logits, to_host=True)
    for i, n in enumerate(LENGTHS):
        engine.add_request(f"r{i}", random_prompt(n, seed=700 + i),
                           SamplingParams(temperature=0, max_tokens=6 + 4 * (i % 3), ignore_eos=True))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.choices[0].token_ids)
        engine.check_integrity()
    return out


@pytest.mark.parametrize("engram", ["device", "host"])
def test_graph_decode_matches_eager(engram):
    formats = "checkpoint"
    model = tiny_on_cuda(formats)
    dtype = "float32" if formats == "float32" else "bfloat16"
    if engram == "host":
        tables_to_host_(model, "cuda")
    eager_l, graph_l = [], []
    eager, graphed = _engine(model, dtype, False), _engine(model, dtype, True)
    want, got = _run(eager, eager_l), _run(graphed, graph_l)
    g = graphed.runner.paged.graphs
    assert eager.runner.paged.graphs is None
    assert g.captures >= 2 and g.runs >= 10, (g.captures, g.runs)
    worst, exact = 0.0, 0
    for a, b in zip(eager_l, graph_l):
        if a is not None:
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
            exact += int(torch.equal(a, b))
    print(f"{formats}, Engram on {engram}: graph vs eager logits worst {worst:.3g}, {exact}/{sum(x is not None for x in eager_l)} "
          f"steps bit-identical; {g.captures} graphs, {g.runs} replays")
    assert worst <= TOL
    assert got == want


def test_float_experts_are_not_captured():
    model = tiny_on_cuda("float32")
    engine = _engine(model, "float32", True)
    assert engine.runner.paged.graphs is None  # the float experts' reference loop reads routing on the host


def test_graph_verify_steps_match_eager():
    model = tiny_on_cuda("checkpoint", with_dspark=True)
    want = _run(_engine(model, "bfloat16", False), [])

    def speculative(graphs):
        cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, forward="batched", dtype="bfloat16",
                           device="cuda", cuda_graphs=graphs, speculative_tokens=3, speculative_adaptive=False)
        eng = Engine(model, cfg, KVStoreConfig(block_size=16, num_blocks=400))
        force_drafts(eng, {(rid, 0): toks for rid, toks in want.items()})
        return eng

    eager_l, graph_l = [], []
    eager, graphed = speculative(False), speculative(True)
    got_eager, got_graph = _run(eager, eager_l), _run(graphed, graph_l)
    g = graphed.runner.paged.graphs
    assert g.captures >= 1 and g.runs >= 4, (g.captures, g.runs)
    assert graphed.stats().spec_accepted_tokens > 0
    assert len(eager_l) == len(graph_l)
    for a, b in zip(eager_l, graph_l):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    assert got_graph == got_eager


def test_draft_graphs_match_the_eager_proposal():
    """The drafter's captured proposal (engine/spec/draft_graphs.py) against the eager ops on the same rings:
    batches of 3 and 5 replayed from the 4- and 8-sequence graphs, k = 1 and 3, greedy and with two sampling
    rows (the same noise). The drafts must be equal, the confidences (fp32) agree to 1e-4 relative and q to
    1e-6: only the attention's batched products see the padded row count."""
    from flashtier.engine.model.dspark import draft_block, new_rings
    from flashtier.engine.spec.draft_graphs import DraftGraphs, DraftSampling, draw_noise, greedy_drafts, sampled_drafts

    model = tiny_on_cuda("checkpoint", with_dspark=True)
    assert DraftGraphs.supported(model)
    graphs = DraftGraphs(model, (1, 2, 4, 8), 3, capture=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, k in ((3, 1), (5, 3), (3, 3)):
        rings, positions = [], []
        for i in range(b):
            r = new_rings(model.cfg, len(model.mtp), model.device, model.compute_dtype)
            p = 40 + 37 * i  # ring slots of positions < p (the newest W of them)
            held = torch.arange(max(0, p - r.pos.shape[1]), p, device="cuda")
            r.pos[:, held % r.pos.shape[1]] = held
            r.kv.normal_(generator=gen)
            rings.append(r)
            positions.append(p)
        last = torch.randint(0, model.cfg.vocab_size, (b,), device="cuda", generator=gen)
        pos = torch.tensor(positions, device="cuda")
        want = greedy_drafts(model, draft_block(model, rings, last, pos), last, k)
        got = graphs.run(rings, last, pos, k)
        got_again = graphs.run(rings, last, pos, k)  # a replay, not the capture's first run
        assert torch.equal(got.drafts, want.drafts) and torch.equal(got_again.drafts, want.drafts), (b, k)
        rel = float((got.confidence - want.confidence).abs().max() / want.confidence.abs().max())
        assert rel <= 1e-4, (b, k, rel)
        # rows 0 and 2 sample: the same noise through the captured sampled graph and the eager ops
        noise = draw_noise([torch.Generator(device="cuda").manual_seed(7 + j) for j in (0, 2)], k,
                           model.cfg.vocab_size, model.device)
        sampling = DraftSampling((0, 2), (0.8, 1.1), noise)
        full = torch.ones(b, k, model.cfg.vocab_size, device="cuda")
        full[[0, 2]] = noise
        temp = torch.ones(b, device="cuda")
        temp[0], temp[2] = 0.8, 1.1
        mask = torch.zeros(b, dtype=torch.bool, device="cuda")
        mask[[0, 2]] = True
        want = sampled_drafts(model, draft_block(model, rings, last, pos), last, k, full, temp, mask)
        got = graphs.run(rings, last, pos, k, sampling)
        assert torch.equal(got.drafts, want.drafts), (b, k)
        assert float((got.q - want.q).abs().max()) <= 1e-6, (b, k)
    assert graphs.captures == 6 and graphs.runs == 9
