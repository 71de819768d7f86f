"""Self-speculative decoding on tiny random models: exact greedy equivalence, forced full acceptance,
the exact joint distribution of sampled tokens, and cache invariants over many rounds."""

import itertools

import pytest
import torch

from selfspec import Engine, SamplingParams, SelfspecError, SpecConfig
from selfspec.calibration.distribution import sample_continuations
from selfspec.calibration.rollout import generate_batch
from selfspec.decoding.drafter import ExitDrafter
from selfspec.decoding.round import RoundInput, speculative_round

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("draft_layers,gamma", list(itertools.product([1, 2, 3], [1, 3, 8])))
def test_greedy_speculative_equals_plain(tiny_engine, draft_layers, gamma):
    for prompt in ("hello", "The quick brown fox", "1 2 3 4"):
        plain = tiny_engine.generate(prompt, GREEDY)
        spec = tiny_engine.generate(prompt, GREEDY, speculation=SpecConfig(draft_layers, gamma))
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        s = spec.stats.spec
        assert s.rounds > 0 and s.drafted >= s.rounds and 0 <= s.accepted <= s.drafted
        assert s.mean_tokens_per_round == pytest.approx(1 + s.accepted / s.rounds)
        assert spec.stats.steps == s.rounds + s.full_steps
    assert tiny_engine.cache.num_used_blocks == 0


def test_identity_upper_layers_accept_everything(tiny_checkpoint):
    """With layers [N, L) zeroed out (each adds nothing to the residual stream) the draft is the
    target, so every draft is accepted, greedy and sampled alike."""
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    for layer in engine.model.layers[2:]:
        layer.o = engine.model.make_linear(torch.zeros(layer.o.out_features, layer.o.in_features))
        layer.down = engine.model.make_linear(torch.zeros(layer.down.out_features, layer.down.in_features))
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)):
        r = engine.generate("hi", params, speculation=SpecConfig(2, 4))
        s = r.stats.spec
        # one plain first step, then 7 rounds of 4 drafts + 1, then a last round capped at 3 drafts
        assert (s.rounds, s.drafted, s.accepted) == (8, 31, 31) and s.acceptance_rate == 1.0
        assert s.drafted_per_position == [8, 8, 8, 7] and s.accepted_per_position == [8, 8, 8, 7]
        assert s.to_dict()["acceptance_per_position"] == [1.0] * 4


def test_spec_config_validation(tiny_engine):
    for kwargs, needle in [
        ({"draft_layers": 0}, "draft_layers=0"),
        ({"draft_layers": 2, "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"draft_layers": 2, "num_speculative_tokens": 33}, "num_speculative_tokens=33"),
        ({"draft_layers": 1.5}, "draft_layers=1.5"),
    ]:
        with pytest.raises(ValueError, match=needle):
            SpecConfig(**kwargs)
    with pytest.raises(SelfspecError, match="draft_layers=4 is invalid for a 4-layer model: use 1..3"):
        tiny_engine.generate("x", GREEDY, speculation=SpecConfig(4, 2))


def test_speculation_respects_max_tokens_and_stop(tiny_engine):
    plain = tiny_engine.generate("abc", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    spec = tiny_engine.generate(
        "abc", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), speculation=SpecConfig(3, 8)
    )
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 7
    stop = plain.token_ids[4]
    r = tiny_engine.generate(
        "abc", SamplingParams(temperature=0, max_tokens=7, stop_token_ids=(stop,)), speculation=SpecConfig(3, 8)
    )
    assert r.token_ids == plain.token_ids[: plain.token_ids.index(stop) + 1] and r.finish_reason == "stop"


# ---- sampled: the exact joint distribution of the first two tokens ------------------------------------

VOCAB = 12


def exact_joint(model, prompt, params):
    """[VOCAB, VOCAB]: P(t1, t2 | prompt) under the processed target distribution."""
    from selfspec.decoding.sampling import process_logits

    cache = model.new_cache(256, block_size=4)
    seqs = [cache.allocate() for _ in range(VOCAB)]
    tokens = torch.tensor([prompt + [t] for t in range(VOCAB)])  # every first token, teacher-forced
    probs = process_logits(model.logits(model.forward(tokens, cache, seqs)), params)
    first = probs[0, len(prompt) - 1]  # [VOCAB]
    return first[:, None] * probs[:, len(prompt)]  # [VOCAB, VOCAB]


@pytest.mark.parametrize(
    "params,spec",
    [
        (SamplingParams(temperature=1.0), SpecConfig(1, 2)),
        (SamplingParams(temperature=0.7, top_k=8, top_p=0.9), SpecConfig(2, 3)),
    ],
    ids=["T=1", "T=0.7,top_k,top_p"],
)
@torch.inference_mode()
def test_sampled_joint_distribution_is_exact(small_vocab_model, params, spec):
    """30k speculative samples of (t1, t2) against the exact joint. Chi-square over cells with an
    expected count >= 5 (the rest pooled); the false-failure probability at the 1e-4 threshold is 1e-4,
    and the fixed seeds make the outcome reproducible."""
    from scipy import stats

    model, prompt, n = small_vocab_model, [1, 5, 7, 2], 30_000
    joint = exact_joint(model, prompt, params).double()
    cache = model.new_cache(200_000, block_size=4)
    samples = sample_continuations(model, cache, prompt, params, spec, n, 2, seed=11, chunk=5000)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in samples:
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0  # nothing the target excludes (top-k / top-p)
    expected = (joint * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:  # pool the rare cells into one
        obs = torch.cat([obs, observed[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    assert stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-4
    assert cache.num_used_blocks == 0


# ---- cache invariants over many random accept / reject rounds ----------------------------------------


@torch.inference_mode()
def test_cache_invariants_over_random_rounds(small_vocab_model):
    model = small_vocab_model
    cache = model.new_cache(4096, block_size=4)
    gen = torch.Generator().manual_seed(0)
    seqs, tokens = [], []
    for i in range(6):  # sequences of different lengths share the batch
        seqs.append(cache.allocate())
        prompt = torch.randint(0, VOCAB, (3 + 2 * i,), generator=gen).tolist()
        model.prefill(cache, seqs[-1], prompt[:-1])
        tokens.append(prompt)
    params = [SamplingParams(temperature=1.5)] * 6
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    accepted_seen = set()
    for round_ in range(400):
        drafter, gamma = ExitDrafter(1 + round_ % 3), 1 + round_ % 5
        step = RoundInput(seqs, [t[-1] for t in tokens], params, gens, [gamma] * 6, drafter)
        result = speculative_round(model, cache, step)
        for b, seq in enumerate(seqs):
            tokens[b] += result.tokens[b]
            assert seq.length == len(tokens[b]) - 1  # everything but the last token is cached
            assert len(seq.block_table) == cache.blocks_needed(seq.length)
        accepted_seen.update(result.num_accepted)
        counts = [0] * cache.num_blocks
        for seq in seqs:
            for blk in seq.block_table:
                counts[blk] += 1
        assert counts == cache.refcount
        if round_ % 50 == 49:  # retire the longest sequence, start a fresh one
            b = max(range(6), key=lambda i: len(tokens[i]))
            cache.free(seqs[b])
            seqs[b], tokens[b] = cache.allocate(), [1, 2]
            model.prefill(cache, seqs[b], [1])
    assert len(accepted_seen) >= 4  # rounds really did accept and reject varying amounts
    for seq in seqs:
        cache.free(seq)
    assert cache.num_used_blocks == 0


@torch.inference_mode()
def test_mixed_batch_greedy_rows_equal_their_isolated_runs(small_vocab_model):
    """Rows drafting 0 (plain), 1, 2 and 4 tokens, with different prompt lengths, share every pass of
    each round; greedy, each row's output equals plain decoding of that row alone (fp32)."""
    model = small_vocab_model
    cache = model.new_cache(4096, block_size=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [3, 3, 3, 3, 3, 3, 3, 3, 3]]
    greedy = [SamplingParams(temperature=0)] * 4

    def alone(prompt, n):
        seq = cache.allocate()
        model.prefill(cache, seq, prompt[:-1])
        out = generate_batch(model, cache, [seq], [prompt[-1]], greedy[0], None, [None], n)[0]
        cache.free(seq)
        return out

    expected = [alone(p, 24) for p in prompts]
    seqs = [cache.allocate() for _ in prompts]
    for seq, p in zip(seqs, prompts):
        model.prefill(cache, seq, p[:-1])
    outs = [[] for _ in prompts]
    while min(len(o) for o in outs) < 24:
        last = [o[-1] if o else p[-1] for o, p in zip(outs, prompts)]
        r = speculative_round(model, cache, RoundInput(seqs, last, greedy, [None] * 4, [0, 1, 2, 4], ExitDrafter(2)))
        assert r.drafted == [0, 1, 2, 4] and r.num_accepted[0] == 0 and len(r.tokens[0]) == 1
        for o, t in zip(outs, r.tokens):
            o += t
    assert [o[:24] for o in outs] == expected
    for seq in seqs:
        cache.free(seq)
    assert cache.num_used_blocks == 0


@torch.inference_mode()
def test_mixed_batch_sampled_rows_follow_the_target(small_vocab_model):
    """One round from the prompt for 24k rows whose draft caps cycle through 0..3: the first token of
    every cap group follows the exact next-token distribution (chi-square, 1e-4 level, fixed seeds)."""
    from scipy import stats

    model, prompt = small_vocab_model, [2, 7, 1]
    params = SamplingParams(temperature=0.9)
    exact = exact_joint(model, prompt, params).sum(1).double()  # P(t1)
    cache = model.new_cache(400_000, block_size=4)
    root = cache.allocate()
    model.prefill(cache, root, prompt[:-1])
    rows, caps = 6000, [0, 1, 2, 3]
    seqs = [cache.fork(root) for _ in range(rows * 4)]
    gammas = [caps[i % 4] for i in range(len(seqs))]
    gens = [torch.Generator().manual_seed(i) for i in range(len(seqs))]
    step = RoundInput(seqs, [prompt[-1]] * len(seqs), [params] * len(seqs), gens, gammas, ExitDrafter(1))
    r = speculative_round(model, cache, step)
    for cap in caps:
        first = torch.tensor([r.tokens[i][0] for i in range(len(seqs)) if gammas[i] == cap])
        counts = torch.bincount(first, minlength=VOCAB).double()
        keep = exact * rows >= 5
        assert counts[exact == 0].sum() == 0
        assert (
            stats.chisquare(counts[keep].numpy(), (exact[keep] / exact[keep].sum() * counts[keep].sum()).numpy()).pvalue
            > 1e-4
        )
    for s in seqs + [root]:
        cache.free(s)
    assert cache.num_used_blocks == 0


def test_drafter_choice_is_named_and_checked(tiny_engine):
    """`exit` drafts with the plain early exit and says so; `head` without a head at that depth is a
    clear error, not a silent fallback."""
    r = tiny_engine.generate("abc", GREEDY, speculation=SpecConfig(2, 2, "exit"))
    assert r.stats.spec.drafter == "exit" and r.stats.spec.rounds > 0
    with pytest.raises(SelfspecError, match="no draft head at that depth"):
        tiny_engine.generate("abc", GREEDY, speculation=SpecConfig(2, 2, "head"))
