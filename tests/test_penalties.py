"""Presence / frequency / repetition penalties and logit bias (decoding/sampling.Penalties) and the
target's logprobs of emitted tokens, in plain and speculative rounds: the semantics against a
per-token reference, speculation lossless with them on (greedy equality for every drafter, the exact
joint distribution), a verification that forgets the drafts in the history caught, and logprobs equal
between plain and speculative runs and to a transformers forward."""

import pytest
import torch

from selfspec import SamplingParams, SpecConfig
from selfspec.decoding.drafter import ExitDrafter
from selfspec.decoding.round import RoundInput, run_round
from selfspec.decoding.sampling import Penalties, make_generator, process_logits
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model

from .conftest import tiny_hf_model
from .test_drafters import PROMPT, drafters, small  # noqa: F401  (small: the 12-token model and its int4 copy)
from .test_speculative import VOCAB

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4, logit_bias={3: 1.5, 9: -100})


def reference_penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]):
    """The semantics, token by token: logits [vocab] -> penalized logits [vocab]."""
    out = logits.clone().tolist()
    for t in set(prompt) | set(generated):  # repetition: over prompt and generated tokens
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t in set(generated):  # presence and frequency: over generated tokens only
        out[t] -= params.presence_penalty + params.frequency_penalty * generated.count(t)
    for t, b in params.logit_bias:
        if t < len(out):
            out[t] += b
    return torch.tensor(out)


# ---- the semantics ------------------------------------------------------------------------------------


def test_penalties_match_the_reference_per_step_and_per_position():
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(**PENALTIES),
        SamplingParams(),  # no penalties: left exactly as it is
        SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0, logit_bias={0: 100, 11: 7, 500: 3}),
        SamplingParams(repetition_penalty=0.7),
    ]
    history = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5, 12, 7)]
    prompt_lens = [4, 5, 6, 7]
    pen = Penalties.of(params, history, prompt_lens)
    drafts = [[3, 3, 9], [1, 2], [], [4]]
    logits = torch.randn(4, 4, VOCAB, generator=g) * 3  # [B, γ_max + 1, vocab]
    logits[0, :, 5] = float("-inf")  # stays -inf whatever the penalties
    verified = pen.verify(logits, drafts)
    assert torch.equal(verified[1], logits[1])
    for b, p in enumerate(params):
        prompt, generated = history[b][: prompt_lens[b]], history[b][prompt_lens[b] :]
        for i in range(len(drafts[b]) + 1):  # position i: the history, then d_1 .. d_i
            expected = reference_penalize(logits[b, i], p, prompt, generated + drafts[b][:i])
            torch.testing.assert_close(verified[b, i], expected)
            # A draft step at the same point (drafts so far as extra history) gives the same logits, bit for bit.
            stepped = pen.step(logits[b : b + 1, i], [b], [drafts[b][:i]])
            assert torch.equal(stepped[0], verified[b, i])
    assert verified[0, :, 5].eq(float("-inf")).all() and verified[0, :, 9].lt(-90).all()


def test_no_penalty_no_work_and_missing_context_is_an_error():
    plain = [SamplingParams(temperature=0), SamplingParams(top_p=0.5)]
    assert Penalties.of(plain, None, None) is None  # the common path builds nothing
    assert not SamplingParams(logprobs=3).penalized
    with pytest.raises(ValueError, match="history"):
        Penalties.of([SamplingParams(logit_bias={1: 2.0})], None, None)
    with pytest.raises(ValueError, match="prompt_lens"):
        Penalties.of([SamplingParams(frequency_penalty=1.0)], [[1, 2]], None)
    only_rep = Penalties.of([SamplingParams(repetition_penalty=2.0)], [[1, 2]], None)  # prompt split unneeded
    out = only_rep.step(torch.ones(1, 4), [0], [[3]])
    assert out.tolist() == [[1.0, 0.5, 0.5, 0.5]]


def test_logit_bias_extremes_stay_finite():
    """-100 on all but two tokens, +100 on many: finite logits, probabilities summing to 1."""
    vocab = 1000
    ban = SamplingParams(logit_bias={t: -100 for t in range(2, vocab)})
    force = SamplingParams(logit_bias={t: 100 for t in range(0, vocab, 3)}, temperature=1e-45)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 5
    logits[:, 7] = float("-inf")
    pen = Penalties.of([ban, force], [[1], [1]], [1, 1])
    biased = pen.step(logits, [0, 1], [[], []])
    for b, p in enumerate((ban, force)):
        probs = process_logits(biased[b], p)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert process_logits(biased[0], ban)[2:].sum() < 1e-20  # banned
    assert int(process_logits(biased[1], force).argmax()) % 3 == 0  # forced


# ---- lossless with penalties: greedy equality ----------------------------------------------------------


def decode(model, prompt, params, drafter=None, gamma=4, n=24):
    """n tokens after `prompt` by rounds on `model` (speculative with `drafter`) -> (tokens, accepted)."""
    cache = model.new_cache(1024, block_size=4)
    seq = cache.allocate()
    model.prefill(cache, seq, prompt[:-1])
    tokens, accepted, gen = list(prompt), 0, make_generator(0)
    while len(tokens) < len(prompt) + n:
        step = RoundInput(
            [seq],
            [tokens[-1]],
            [params],
            [gen],
            [gamma if drafter else 0],
            drafter,
            history=[list(tokens)],
            prompt_lens=[len(prompt)],
        )
        r = run_round(model, cache, step)
        tokens += r.tokens[0]
        accepted += r.num_accepted[0]
    cache.free(seq)
    assert cache.num_used_blocks == 0
    return tokens[len(prompt) :][:n], accepted


GREEDY_PENALIZED = SamplingParams(temperature=0, **PENALTIES)
SMALL_PROMPTS = (PROMPT, [3, 3, 3, 3, 3], [4, 8, 1, 10, 4, 8, 1])


@torch.inference_mode()
def test_greedy_speculative_equals_plain_with_penalties_small_vocab(small):  # noqa: F811
    """On the 12-token model drafts are often accepted, so penalties at accepted positions matter."""
    target = small[0]
    plain = [decode(target, p, GREEDY_PENALIZED)[0] for p in SMALL_PROMPTS]
    unpenalized = [decode(target, p, SamplingParams(temperature=0))[0] for p in SMALL_PROMPTS]
    assert plain != unpenalized  # the penalties change the output
    for name, drafter in dict(drafters(small), exit=ExitDrafter(2)).items():
        accepted = 0
        for prompt, expected in zip(SMALL_PROMPTS, plain):
            tokens, a = decode(target, prompt, GREEDY_PENALIZED, drafter)
            assert tokens == expected, name
            accepted += a
        assert accepted > 0, name


def test_greedy_speculative_equals_plain_with_penalties_engine(tiny_engine):
    """End to end through the engine (its prompt/output split): exit, int4, lookup, hybrid."""
    # A negative presence penalty and a repetition penalty below 1 favour repeats: lookup finds drafts.
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        presence_penalty=-0.5,
        frequency_penalty=0.4,
        repetition_penalty=0.8,
        logit_bias={1000: 3.0, 2: -100},
    )
    prompts = ("The quick brown fox jumps over the quick brown", "1 2 3 4 1 2 3")
    plain = [tiny_engine.generate(p, params, speculation=None, chat=False).token_ids for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert plain != [tiny_engine.generate(p, greedy, speculation=None, chat=False).token_ids for p in prompts]
    for config in (
        SpecConfig(2, 4, "exit"),
        SpecConfig(None, 4, "int4"),
        SpecConfig(None, 4, "lookup"),
        SpecConfig(None, 4, "hybrid"),
    ):
        rounds = 0
        for prompt, expected in zip(prompts, plain):
            r = tiny_engine.generate(prompt, params, speculation=config, chat=False)
            assert r.token_ids == expected, config.drafter
            rounds += r.stats.spec.rounds
        assert rounds > 0, config.drafter
    assert tiny_engine.cache.num_used_blocks == 0


@pytest.fixture(scope="module")
def identity_upper():
    """The 12-token model with layers [2, 4) adding nothing: the exit at 2 drafts exactly the target."""
    hf = tiny_hf_model("llama", vocab_size=12, num_hidden_layers=4, initializer_range=0.4, seed=5)
    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict().get, torch.float32)
    for layer in model.layers[2:]:
        layer.o = model.make_linear(torch.zeros(layer.o.out_features, layer.o.in_features))
        layer.down = model.make_linear(torch.zeros(layer.down.out_features, layer.down.in_features))
    return model


@torch.inference_mode()
def test_drafts_penalized_like_the_target_are_all_accepted(identity_upper):
    """The draft's q goes through the same penalties over its own running history: where the draft is
    the target, every draft is accepted, greedy and sampled."""
    sampled = SamplingParams(temperature=1.0, **PENALTIES)
    for params in (GREEDY_PENALIZED, sampled):
        tokens, accepted = decode(identity_upper, PROMPT, params, ExitDrafter(2), gamma=4, n=25)
        assert accepted == 20  # 5 rounds of 4 accepted drafts + 1 bonus


# ---- lossless with penalties: the exact joint distribution ---------------------------------------------


def exact_joint_penalized(model, prompt, params):
    """[VOCAB, VOCAB]: P(t1, t2 | prompt) under the target, each position penalized by the reference."""
    cache = model.new_cache(256, block_size=4)
    seqs = [cache.allocate() for _ in range(VOCAB)]
    tokens = torch.tensor([prompt + [t] for t in range(VOCAB)])  # every first token, teacher-forced
    logits = model.logits(model.forward(tokens, cache, seqs))  # [VOCAB, T + 1, VOCAB]
    first = process_logits(reference_penalize(logits[0, len(prompt) - 1], params, prompt, []), params)
    second = torch.stack(
        [process_logits(reference_penalize(logits[t, len(prompt)], params, prompt, [t]), params) for t in range(VOCAB)]
    )
    return first[:, None] * second  # [VOCAB, VOCAB]


def sample_pairs(model, drafter, params, n=30_000, gamma=3, seed=11, chunk=5000) -> list[list[int]]:
    """n speculative samples of the first two tokens after PROMPT (row i seeded with seed + i)."""
    cache = model.new_cache(200_000, block_size=4)
    root = cache.allocate()
    model.prefill(cache, root, PROMPT[:-1])
    out = []
    for first in range(0, n, chunk):
        rows = min(chunk, n - first)
        seqs = [cache.fork(root) for _ in range(rows)]
        gens = [make_generator(seed + first + i) for i in range(rows)]
        tokens = [[] for _ in range(rows)]
        while min(len(t) for t in tokens) < 2:
            history = [PROMPT + t for t in tokens]
            step = RoundInput(
                seqs,
                [h[-1] for h in history],
                [params] * rows,
                gens,
                [gamma] * rows,
                drafter,
                history=history,
                prompt_lens=[len(PROMPT)] * rows,
            )
            for t, new in zip(tokens, run_round(model, cache, step).tokens):
                t += new
        out += [t[:2] for t in tokens]
        for s in seqs:
            cache.free(s)
    cache.free(root)
    assert cache.num_used_blocks == 0
    return out


def joint_pvalue(model, drafter, params, n=30_000) -> float:
    from scipy import stats

    joint = exact_joint_penalized(model, PROMPT, params).double()
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in sample_pairs(model, drafter, params, n):
        counts[a, b] += 1
    assert counts[joint < 1e-30].sum() == 0  # never a banned token (logit_bias -100)
    expected, observed = (joint * n).flatten(), counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


SAMPLED_PENALIZED = SamplingParams(temperature=1.0, **PENALTIES)


@pytest.mark.parametrize("name", ["lookup", "int4"])
@torch.inference_mode()
def test_sampled_joint_distribution_is_exact_with_penalties(small, name):  # noqa: F811
    """30k speculative samples of (t1, t2) with penalties and logit bias on against the exact joint of
    the reference semantics (chi-square at 1e-4, fixed seeds). The lookup drafts 2, 1, 5 here, so t2 is
    judged after an accepted draft that its presence / frequency penalties must count."""
    assert joint_pvalue(small[0], drafters(small)[name], SAMPLED_PENALIZED) > 1e-4


@torch.inference_mode()
def test_verification_without_the_drafts_in_the_history_is_caught(small, monkeypatch):  # noqa: F811
    """A mutation: verification penalizing every position with the round's history alone (as if no
    draft came before it) is caught by the joint distribution (lookup) and by greedy equality (int4,
    whose drafts are accepted often enough here)."""
    right = Penalties.verify
    monkeypatch.setattr(Penalties, "verify", lambda self, logits, drafts: right(self, logits, [[] for _ in drafts]))
    target, found = small[0], drafters(small)
    assert joint_pvalue(target, found["lookup"], SAMPLED_PENALIZED) < 1e-4
    int4 = found["int4"]
    assert all(
        decode(target, p, GREEDY_PENALIZED)[0] != decode(target, p, GREEDY_PENALIZED, int4)[0] for p in SMALL_PROMPTS
    )


# ---- logprobs -------------------------------------------------------------------------------------------


def reference_logprobs(checkpoint, ids: list[int]) -> torch.Tensor:
    """[T, vocab] log-softmax of a transformers forward over the whole sequence (fp32, eager)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_against_reference(reference: torch.Tensor, prompt_len: int, result, k: int) -> None:
    assert len(result.logprobs) == len(result.token_ids)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        row = reference[prompt_len - 1 + i]  # the position that predicts output token i
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        values, ids = row.topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)


def test_logprobs_equal_plain_speculative_and_reference(tiny_engine, tiny_checkpoint):
    """Greedy with penalties on: plain and speculative runs give the same tokens and logprobs (1e-5);
    logprobs are the raw target's (a transformers forward over prompt + output), not the penalized ones."""
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logprobs=5, presence_penalty=0.5, repetition_penalty=1.2
    )
    prompt = "The quick brown fox jumps over the quick brown"
    plain = tiny_engine.generate(prompt, params, speculation=None, chat=False)
    for config in (SpecConfig(2, 4, "exit"), SpecConfig(None, 4, "int4")):
        spec = tiny_engine.generate(prompt, params, speculation=config, chat=False)
        assert spec.token_ids == plain.token_ids and spec.stats.spec.rounds > 0
        for a, b in zip(plain.logprobs, spec.logprobs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            torch.testing.assert_close(
                torch.tensor([a.logprob, *(v for _, v in a.top)]),
                torch.tensor([b.logprob, *(v for _, v in b.top)]),
                atol=1e-5,
                rtol=0,
            )
    ids = tiny_engine.encode(prompt, chat=False)
    check_against_reference(reference_logprobs(tiny_checkpoint, ids + plain.token_ids), len(ids), plain, 5)


def test_sampled_speculative_logprobs_follow_the_emitted_tokens(tiny_engine, tiny_checkpoint):
    """Sampled speculation (accepted drafts, recovered and bonus tokens): each token's logprob is the
    reference's at its own position; logprobs=0 gives no alternatives; chunks carry them too."""
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True, logprobs=3)
    prompt = "1 2 3 4 1 2 3"
    spec = tiny_engine.generate(prompt, params, speculation=SpecConfig(2, 4, "exit"), chat=False)
    assert spec.stats.spec.rounds > 0
    ids = tiny_engine.encode(prompt, chat=False)
    check_against_reference(reference_logprobs(tiny_checkpoint, ids + spec.token_ids), len(ids), spec, 3)
    chunks = list(tiny_engine.stream_generate(prompt, SamplingParams(max_tokens=4, logprobs=0), chat=False))
    assert all(c.logprob is not None and c.logprob.top == () for c in chunks)
    assert all(c.logprob.token_id == c.token_id and c.logprob.logprob <= 0 for c in chunks)
    r = tiny_engine.generate(prompt, SamplingParams(max_tokens=4), chat=False)
    assert r.logprobs is None and "logprobs" not in r.to_dict()


def test_append_keeps_the_logprobs_of_kept_tokens(tiny_engine):
    from selfspec.decoding.sampling import TokenLogprob

    ids = tiny_engine.encode("abc", chat=False)
    req = tiny_engine.add_request(ids, SamplingParams(max_tokens=10, stop_token_ids=(7,), logprobs=1))
    lps = [TokenLogprob(t, -float(t), ((t, -float(t)),)) for t in (5, 7, 9)]
    out = req.append([5, 7, 9], lps)  # 7 stops the request: 9 is dropped, with its logprob
    assert out.token_ids == [5, 7] and out.logprobs == lps[:2] and req.finish_reason == "stop"
    assert req.append([]).logprobs is None  # callers without logprobs get none
    tiny_engine.release(req)
