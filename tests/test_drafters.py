"""The drafters beyond the early exit: context lookup, the model's own weights quantized (int4/int8),
and the per-row hybrid. Lossless greedy and sampled, the draft's K/V rewritten by verification, and
mutations (a wrong q, draft K/V left in place) caught."""

import pytest
import torch
import torch.nn.functional as F

from selfspec import SamplingParams, SpecConfig
from selfspec.calibration.distribution import sample_continuations
from selfspec.decoding.drafter import Draft, Drafter, ExitDrafter
from selfspec.decoding.hybrid import HybridDrafter
from selfspec.decoding.lookup import LookupDrafter, match
from selfspec.decoding.mixed import MixedDrafter
from selfspec.decoding.quantized import SHORTLIST, QuantizedDrafter, Shortlist, share_embeddings, shortlist
from selfspec.decoding.round import RoundInput, speculative_round
from selfspec.kernels import native
from selfspec.kernels.choice import QUANTIZED, plan
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model

from .conftest import tiny_hf_model
from .test_speculative import VOCAB, exact_joint

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_match_takes_the_longest_recurring_suffix_most_recent_first():
    assert match([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 4) == [7, 5, 2, 3]  # "2 3" recurs; most recent wins
    assert match([1, 2, 3, 9, 4, 2, 3], 3, 2) == [9, 4]  # "2 3" at the start
    assert match([5, 1, 2, 8, 1, 2], 1, 3) == [8, 1, 2]  # n = 1: "2" last seen before 8
    assert match([1, 2, 3, 4], 3, 4) == []  # nothing recurs
    assert match([7], 3, 4) == [] and match([], 3, 4) == []
    assert match([4, 4, 4], 2, 5) == [4]  # an occurrence overlapping the suffix: only what follows it
    assert match([1, 2, 3, 9, 4, 2, 3], 3, 2, shortest=2) == [9, 4]  # "2 3" is long enough
    assert match([1, 2, 3, 9, 4, 2, 3], 3, 2, shortest=3) == []  # "4 2 3" never recurs: no backing off to 2
    # the suffix's bytes recurring across a token boundary are no match (256 = bytes 00 01 00 00, 1 = 01 00 00 00)
    assert match([1, 5, 256, 0, 1], 1, 1) == [5]  # not the 0 after "256 0"'s bytes 01 00 00 00
    assert match([5, 9, 256, 0, 256, 7, 1, 0], 2, 2) == [256, 7]  # "1 0" never recurs; "0" does


def test_match_equals_a_plain_search_of_every_suffix():
    """On random histories of a few ids (many recurrences, overlaps, ids whose bytes repeat inside
    others), the first tokens after the latest earlier occurrence of the longest recurring suffix."""

    def reference(history: list[int], ngram: int, limit: int, shortest: int) -> list[int]:
        for n in range(min(ngram, len(history) - 1), shortest - 1, -1):
            suffix = history[-n:]
            starts = [i for i in range(len(history) - n) if history[i : i + n] == suffix]
            if starts:
                return history[starts[-1] + n : starts[-1] + n + limit]
        return []

    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 1, 256, 65536, 16777216, 49151])
    for _ in range(400):
        length = int(torch.randint(0, 40, (1,), generator=g))
        history = ids[torch.randint(0, len(ids), (length,), generator=g)].tolist()
        for ngram, shortest in ((3, 2), (3, 1), (1, 1), (5, 3)):
            assert match(history, ngram, 4, shortest) == reference(history, ngram, 4, shortest), (history, ngram)


class Fixed(Drafter):
    """A stand-in model drafter: proposes token 99 at every position it is asked for."""

    def propose(self, model, cache, step) -> Draft:
        return Draft([[99] * g for g in step.gammas], [[] for _ in step.gammas])


def test_hybrid_looks_up_only_whole_ngrams():
    """Lookup alone backs off to a two-token match by default (lookup.SHORTEST), to one where asked; the
    hybrid drafts with its model drafter there, and by lookup only where the last `ngram` tokens recur."""
    history = [[1, 2, 3, 1, 2, 3], [5, 6, 7, 6]]  # row 0: "1 2 3" recurs; row 1: only "6" does
    step = RoundInput([None, None], [3, 6], [GREEDY] * 2, [None] * 2, [2, 2], None, history=history)
    assert LookupDrafter(3, shortest=1).propose(None, None, step).tokens == [[1, 2], [7, 6]]
    assert LookupDrafter(3).propose(None, None, step).tokens == [[1, 2], []]
    assert LookupDrafter(1).shortest == 1  # an n-gram of 1 backs off to nothing shorter
    assert HybridDrafter(3, Fixed()).propose(None, None, step).tokens == [[1, 2], [99, 99]]
    assert HybridDrafter(3, None).propose(None, None, step).tokens == [[1, 2], []]  # no fallback: a plain step


class Tagged(Drafter):
    """Proposes its tag at every position it is asked for, and records the γs it was asked with."""

    def __init__(self, tag: int) -> None:
        self.tag, self.asked = tag, []

    def propose(self, model, cache, step) -> Draft:
        self.asked.append(list(step.gammas))
        return Draft([[self.tag] * g for g in step.gammas], [[] for _ in step.gammas])


def test_mixed_drafter_gives_each_row_its_own_drafters_tokens():
    a, b = Tagged(7), Tagged(8)
    step = RoundInput([None] * 4, [1] * 4, [GREEDY] * 4, [None] * 4, [2, 3, 0, 1], None, history=[[1]] * 4)
    draft = MixedDrafter([a, b], [0, 1, 1, 0]).propose(None, None, step)
    assert draft.tokens == [[7, 7], [8, 8, 8], [], [7]]
    assert a.asked == [[2, 0, 0, 1]] and b.asked == [[0, 3, 0, 0]]  # each asked for its own rows only
    with pytest.raises(ValueError, match="layer 0"):
        MixedDrafter([a, ExitDrafter(1)], [0, 1])


def test_a_hybrids_unmatched_rows_draft_in_its_fallbacks_passes():
    """Rows of the int4 drafter and of a hybrid whose fallback is that same drafter: lookup serves the
    hybrid row whose trigram recurs, and the model drafter is asked once, for its own row and the
    hybrid's unmatched one together."""
    model = Tagged(9)
    history = [[4, 5, 6], [1, 2, 3, 1, 2, 3], [5, 6, 7, 6]]  # row 1's trigram recurs, row 2's does not
    step = RoundInput([None] * 3, [6, 3, 6], [GREEDY] * 3, [None] * 3, [2, 2, 2], None, history=history)
    draft = MixedDrafter([model, HybridDrafter(3, model)], [0, 1, 1]).propose(None, None, step)
    assert draft.tokens == [[9, 9], [1, 2], [9, 9]]
    assert model.asked == [[2, 0, 2]]


def test_requests_with_different_drafters_verify_in_one_pass(tiny_engine, monkeypatch):
    """A batch whose requests draft with int4, int8, lookup and the hybrid (and one plain request) runs
    one round per step, not one per drafter, and each request's greedy output equals plain decoding."""
    prompts = ["hello hello hello", "The quick brown fox jumps over the quick brown", "1 2 3 4 1 2 3", "a b a b", "x"]
    plain = [tiny_engine.generate(p, GREEDY, speculation=None).token_ids for p in prompts]
    configs = [SpecConfig(None, 4, d) for d in ("int4", "int8", "lookup", "hybrid")] + [None]
    reqs = [tiny_engine.add_request(tiny_engine.encode(p), GREEDY, c) for p, c in zip(prompts, configs)]
    rounds, real = [], tiny_engine._round
    monkeypatch.setattr(
        tiny_engine, "_round", lambda group, drafter, gammas: rounds.append(drafter) or real(group, drafter, gammas)
    )
    steps = 0
    while live := [r for r in reqs if not r.finished]:
        tiny_engine.step_batch(live)
        steps += 1
    assert [r.output_ids for r in reqs] == plain
    assert len(rounds) == steps  # one round (one verification pass) per step, whatever the drafters
    assert any(isinstance(d, MixedDrafter) for d in rounds)
    for r in reqs:
        tiny_engine.release(r)


def test_a_batched_round_caps_the_policys_gamma_not_the_requests(tiny_engine, monkeypatch):
    """Where the policy chose γ (each bucket's, for a request alone), a batch of speculating requests
    drafts at most the γ calibration measured batches at (SpecPolicy.batch_gamma); a γ the request
    asked for is kept; one request alone keeps its own."""
    monkeypatch.setattr(tiny_engine.policy, "batch_gamma", lambda n: 2 if n > 1 else None)
    prompts = ["hello hello hello", "The quick brown fox jumps over the quick brown", "1 2 3 4 1 2 3"]
    reqs = [tiny_engine.add_request(tiny_engine.encode(p), GREEDY, SpecConfig(None, 5, "int4")) for p in prompts]
    reqs[0].policy_gamma = reqs[1].policy_gamma = True  # as the policy's "auto" decisions are marked
    seen, real = [], tiny_engine._round
    monkeypatch.setattr(tiny_engine, "_round", lambda g, d, gammas: seen.append(gammas) or real(g, d, gammas))
    for _ in range(3):
        tiny_engine.step_batch(reqs)  # the first step is plain (0 drafts); then 3 drafting rows
    assert seen[1:] == [[2, 2, 5], [2, 2, 5]]
    tiny_engine.step_batch(reqs[:1])  # alone: the policy's own γ
    assert seen[-1] == [5]
    for r in reqs:
        tiny_engine.release(r)


# ---- greedy: every drafter's output equals plain decoding ---------------------------------------------


def test_greedy_equals_plain_for_every_drafter(tiny_engine):
    prompts = ("hello hello hello", "The quick brown fox jumps over the quick brown", "1 2 3 4 1 2 3")
    plain = [tiny_engine.generate(p, GREEDY, speculation=None).token_ids for p in prompts]
    for drafter in ("lookup", "int4", "int8", "hybrid"):
        rounds = 0
        for prompt, expected in zip(prompts, plain):
            # lookup from 1-token matches: the tiny random model's output repeats no 2-token suffix
            config = SpecConfig(None, 4, drafter, 1 if drafter == "lookup" else 3)
            spec = tiny_engine.generate(prompt, GREEDY, speculation=config)
            assert spec.token_ids == expected, drafter
            assert spec.stats.spec.drafter == drafter
            rounds += spec.stats.spec.rounds
        assert rounds > 0, drafter  # lookup drafts only where the context repeats itself
    assert tiny_engine.cache.num_used_blocks == 0


def test_quantized_draft_reports_its_memory_and_depth(tiny_engine):
    full = tiny_engine.drafter(SpecConfig(None, 4, "int4"))
    two = tiny_engine.drafter(SpecConfig(2, 4, "int4"))
    assert full.describe()["draft_layers"] == 4 and two.describe()["draft_layers"] == 2
    assert full.draft is two.draft  # one quantized copy per format, shared by every depth
    assert full.describe()["memory_mb"] > 0
    assert full.draft.embed_weight is tiny_engine.model.embed_weight  # only the linears are added
    r = tiny_engine.generate("abc abc abc", GREEDY, speculation=SpecConfig(2, 3, "int4"))
    assert r.stats.spec.draft_layers == 2 and r.stats.spec.rounds > 0


@torch.inference_mode()
def test_the_quantized_draft_shortlists_a_4_bit_head(tiny_engine, monkeypatch):
    """The draft's head scores the vocabulary in 4 bits and rescores the SHORTLIST highest from the float
    head: there its scores are the float head's, elsewhere the 4-bit ones; the same without native.c
    (torch's topk and bmm); and it reads fewer bytes than an int8 head of the same weight."""
    draft = tiny_engine.drafter(SpecConfig(None, 4, "int4")).draft
    head = draft.head
    assert (
        isinstance(head, Shortlist) and tiny_engine.drafter(SpecConfig(None, 4, "int4")).describe()["head"] == head.name
    )
    assert head.weight is tiny_engine.model.head_weight  # the target's float rows, not a copy
    x = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(0))
    coarse, scores = head.coarse.matmul(x).float(), head.matmul(x)  # [3, vocab] each
    exact = x @ tiny_engine.model.head_weight.float().t()
    top = coarse.topk(SHORTLIST, -1).indices
    kept = torch.ones_like(coarse, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.allclose(scores.gather(-1, top), exact.gather(-1, top), rtol=1e-4, atol=1e-4)
    assert torch.equal(scores[kept], coarse[kept])
    assert not torch.allclose(coarse.gather(-1, top), exact.gather(-1, top), rtol=1e-4, atol=1e-4)  # 4 bits differ
    int8 = next(b for b in QUANTIZED["int8"] if b.unavailable(torch.float32) is None)
    assert head.nbytes < int8(tiny_engine.model.head_weight, None, torch.float32).nbytes
    monkeypatch.setattr(native, "library", lambda: None)
    assert torch.allclose(head.matmul(x), scores, rtol=1e-4, atol=1e-4)


# ---- a small-vocabulary model, its int4 copy and the exact joint distribution ---------------------------


@pytest.fixture(scope="module")
def small():
    """(target, its int4 copy): a random 4-layer llama over 12 tokens (as test_speculative's)."""
    hf = tiny_hf_model("llama", vocab_size=12, num_hidden_layers=4, initializer_range=0.4, seed=5)
    config = ModelConfig.from_hf(hf.config.to_dict())
    target = build_model(config, hf.state_dict().get, torch.float32)
    draft = build_model(config, hf.state_dict().get, torch.float32, plan(torch.float32, "int4"))
    assert draft.kernels.weights == "int4"
    return target, share_embeddings(draft, target)


def drafters(small) -> dict:
    quantized = QuantizedDrafter(small[1])
    return {"lookup": LookupDrafter(2), "int4": quantized, "hybrid": HybridDrafter(2, quantized)}


@pytest.fixture(scope="module")
def shortlisted(small):
    """The int4 copy of `small` with the engine's Shortlist head: its drafts run in one native.c call."""
    target = small[0]
    hf = tiny_hf_model("llama", vocab_size=12, num_hidden_layers=4, initializer_range=0.4, seed=5)
    config = ModelConfig.from_hf(hf.config.to_dict())
    head = shortlist(target.head_weight)
    draft = build_model(config, hf.state_dict().get, torch.float32, plan(torch.float32, "int4"), head=head)
    return QuantizedDrafter(share_embeddings(draft, target))


class WrongLookup(LookupDrafter):
    """A mutation: lookup drafts that claim a uniform q instead of their point mass."""

    def propose(self, model, cache, step) -> Draft:
        draft = super().propose(model, cache, step)
        return Draft(draft.tokens, [[torch.full((VOCAB,), 1 / VOCAB)] * len(t) for t in draft.tokens])


PROMPT = [1, 5, 7, 2, 1, 5, 7]  # "5 7" recurs: lookup drafts 2, 1, 5, 7 from the first token on


def chi_square_pvalue(model, drafter, params, n=30_000, chunk=5000) -> float:
    from scipy import stats

    joint = exact_joint(model, PROMPT, params).double()
    cache = model.new_cache(200_000, block_size=4)
    spec = SpecConfig(None, 3, "int4")  # γ; what drafts is `drafter`
    samples = sample_continuations(model, cache, PROMPT, params, spec, n, 2, seed=11, chunk=chunk, drafter=drafter)
    assert cache.num_used_blocks == 0
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in samples:
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0
    expected, observed = (joint * n).flatten(), counts.flatten()
    big = expected >= 5
    rest = expected[~big].sum() > 0  # the small cells lumped together, where there are any
    obs = torch.cat([observed[big], observed[~big].sum()[None]]) if rest else observed[big]
    exp = torch.cat([expected[big], expected[~big].sum()[None]]) if rest else expected[big]
    return stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize("name", ["lookup", "int4", "hybrid"])
@torch.inference_mode()
def test_sampled_joint_distribution_is_exact(small, name):
    """30k speculative samples of (t1, t2) at T=1 against the exact joint (chi-square at 1e-4, fixed
    seeds): the lookup's point mass, the int4 draft's own q, and rows of both in one batch."""
    assert chi_square_pvalue(small[0], drafters(small)[name], SamplingParams(temperature=1.0)) > 1e-4


@torch.inference_mode()
def test_native_sampled_draft_joint_distribution_is_exact(small, shortlisted, monkeypatch):
    """The same through the one-call native draft (ops.Fused.draft draws the tokens and returns q): batches
    of 16 rows, which it takes whole (every call checked), at T = 1 and at T = 0.6 with top-k 4 and top-p
    0.8. A q for the wrong temperature (the mutation) is caught."""
    calls, native_draft = [], shortlisted.draft.ops.draft
    monkeypatch.setattr(shortlisted.draft.ops, "draft", lambda *a: calls.append(native_draft(*a)) or calls[-1])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=4, top_p=0.8)):
        assert chi_square_pvalue(small[0], shortlisted, params, 20_000, chunk=16) > 1e-4
    assert calls and all(c is not None and c[1] is not None for c in calls)

    def wrong(*a):  # q as if drawn at twice the temperature
        tokens, q = native_draft(*a)
        return tokens, torch.softmax(q.log() / 2, -1)

    monkeypatch.setattr(shortlisted.draft.ops, "draft", wrong)
    assert chi_square_pvalue(small[0], shortlisted, SamplingParams(temperature=1.0), 20_000, chunk=16) < 1e-4


@torch.inference_mode()
def test_a_wrong_lookup_q_is_caught(small):
    assert chi_square_pvalue(small[0], WrongLookup(2), SamplingParams(temperature=1.0)) < 1e-4


# ---- the draft's K/V never survive verification ------------------------------------------------------


def cached_kv(cache, seq) -> torch.Tensor:
    """[layers, 2, kv_heads, length, head_dim]: a sequence's cache entries in position order."""
    return torch.stack([layer[:, :, seq.block_table].flatten(2, 3)[:, :, : seq.length] for layer in cache.layers])


@torch.inference_mode()
def test_verification_rewrites_the_draft_kv(small):
    """After int4-drafted rounds, the cache holds exactly what plain decoding of the same tokens
    writes; the draft alone would have left different K/V there (so a skipped rewrite is caught)."""
    target, draft = small
    quantized = QuantizedDrafter(draft)
    greedy = [SamplingParams(temperature=0)]
    cache = target.new_cache(1024, block_size=4)
    spec, plain = cache.allocate(), cache.allocate()
    target.prefill(cache, spec, PROMPT[:-1])
    tokens = list(PROMPT)
    for _ in range(6):
        r = speculative_round(target, cache, RoundInput([spec], [tokens[-1]], greedy, [None], [3], quantized))
        tokens += r.tokens[0]
    target.prefill(cache, plain, PROMPT[:-1])  # plain decoding: the same prefill, then a position per step
    for t in tokens[len(PROMPT) - 1 : -1]:
        target.forward(torch.tensor([[t]]), cache, [plain])
    assert spec.length == plain.length == len(tokens) - 1
    tol = 0.0 if target.kernels.row_exact else 1e-5
    torch.testing.assert_close(cached_kv(cache, spec), cached_kv(cache, plain), atol=tol, rtol=tol)
    # The mutation: a draft pass alone writes K/V of its own at the positions it drafts.
    before = cached_kv(cache, spec)
    step = RoundInput([spec], [tokens[-1]], greedy, [None], [3], quantized)
    quantized.propose(target, cache, step)
    cache.truncate(spec, len(tokens) - 1 + 3)
    drafted = cached_kv(cache, spec)
    assert torch.equal(drafted[:, :, :, : before.shape[3]], before)  # earlier positions untouched
    target.forward(torch.tensor([tokens[-1:]]), cache, [plain])
    assert not torch.allclose(drafted[:, :, :, before.shape[3]], cached_kv(cache, plain)[:, :, :, -1], atol=1e-4)


def same_draw(mine: torch.Tensor, theirs: torch.Tensor, params: SamplingParams) -> bool:
    """Two draft distributions equal within float rounding: top-p's cut may differ by the one token at
    its edge, whose mass before it is top_p up to rounding (native.c sums in double, torch in float),
    and which then has to be the least likely token the distribution keeps; the tokens both keep agree
    once each is renormalized over them."""
    edge = (mine == 0) != (theirs == 0)
    if int(edge.sum()) > (1 if params.top_p < 1 else 0):
        return False
    if edge.any():
        has = mine if bool(mine[edge].sum() > 0) else theirs
        if float(has[edge].sum()) > float(has[~edge & (has > 0)].min()) * (1 + 1e-4):
            return False
    a, b = mine[~edge], theirs[~edge]
    return torch.allclose(a / a.sum(), b / b.sum(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["timed", "native4i8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_rows_draft_in_one_native_call(tiny_checkpoint, dtype, backend, monkeypatch):
    """The quantized draft of rows with one γ runs in one native.c call (ops.Fused.draft): the tokens, the
    cache lengths and the draft K/V are those of the step-by-step path, for a lone row and for a batch (a
    row with γ = 0 drafting nothing), greedy rows and sampled ones, with top-k and top-p too (the same
    tokens from the same seeds, q within float rounding); penalized rows, or rows of different γ, take
    that path. `native4i8`: the draft's layers forced onto the int8-activation kernel, whose passes run
    in one OpenMP team (native.c's team_pass), whatever the timing on this machine picks."""
    from selfspec import Engine
    from selfspec.model import loader

    if backend != "timed":
        if QUANTIZED["int4"][0].unavailable(getattr(torch, dtype)):
            pytest.skip(QUANTIZED["int4"][0].unavailable(getattr(torch, dtype)))
        timed = loader.plan
        forced = {"backend": backend}
        monkeypatch.setattr(
            loader, "plan", lambda d, w="auto", **kw: timed(d, w, **(kw | forced if w == "int4" else kw))
        )
    engine = Engine.from_pretrained(str(tiny_checkpoint), dtype=dtype)
    if backend != "timed":
        assert engine.drafter(SpecConfig(None, 6, "int4")).draft.kernels.backend == backend
        monkeypatch.undo()
    drafter, model, cache = engine.drafter(SpecConfig(None, 6, "int4")), engine.model, engine.cache
    prompts = ("The quick brown fox jumps over", "1 2 3 4 5 6 7", "hello")
    seqs, lasts = [], []
    for text in prompts:
        ids = engine.encode(text, chat=False)
        seqs.append(cache.allocate())
        model.prefill(cache, seqs[-1], ids[:-1])
        lasts.append(ids[-1])
    starts = [s.length for s in seqs]
    greedy, hot, warm = SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0.7)
    nucleus, few = SamplingParams(temperature=1.2, top_p=0.9), SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    native_draft = drafter.draft.ops.draft
    cases = (
        ([0], [6], [greedy]),
        ([0, 1, 2], [5, 5, 0], [greedy] * 3),
        ([0], [6], [hot]),
        ([0, 1, 2], [4, 4, 4], [hot, greedy, warm]),
        ([0, 1, 2], [3, 3, 3], [nucleus, few, SamplingParams(temperature=1.0, top_k=3)]),
    )
    for rows, gammas, params in cases:

        def step() -> RoundInput:  # fresh generators, seeded alike for both paths
            generators = [torch.Generator().manual_seed(7 + r) for r in rows]
            return RoundInput([seqs[r] for r in rows], [lasts[r] for r in rows], params, generators, gammas, drafter)

        calls = []
        monkeypatch.setattr(drafter.draft.ops, "draft", lambda *a: calls.append(a) or native_draft(*a))
        fast = drafter.propose(model, cache, step())
        lengths, kv = [seqs[r].length for r in rows], [cached_kv(cache, seqs[r]) for r in rows]
        assert (
            len(calls) == 1
            and [len(t) for t in fast.tokens] == gammas
            and lengths == [starts[r] + g for r, g in zip(rows, gammas)]
        )
        for r in rows:
            cache.truncate(seqs[r], starts[r])
        monkeypatch.setattr(QuantizedDrafter, "_native", lambda *a: None)
        slow = drafter.propose(model, cache, step())
        assert fast.tokens == slow.tokens
        for p, mine, theirs in zip(params, fast.probs, slow.probs):
            if p.greedy:  # the native path leaves a greedy row's one-hot q to the round
                assert mine == [] and all(torch.equal(q, F.one_hot(q.argmax(), q.shape[-1]).float()) for q in theirs)
            else:
                assert len(mine) == len(theirs) and all(same_draw(a, b, p) for a, b in zip(mine, theirs))
        assert [seqs[r].length for r in rows] == lengths
        assert all(torch.equal(a, cached_kv(cache, seqs[r])) for a, r in zip(kv, rows))
        for r in rows:
            cache.truncate(seqs[r], starts[r])
        monkeypatch.undo()
    history = [engine.encode(prompts[0], chat=False)]
    penalized = SamplingParams(temperature=0.7, presence_penalty=0.5)
    penalties = RoundInput(seqs[:1], lasts[:1], [penalized], [None], [6], drafter, history=history, prompt_lens=[1])
    uneven = RoundInput(seqs[:2], lasts[:2], [greedy] * 2, [None] * 2, [6, 5], drafter)
    assert all(drafter._native(cache, s) is None for s in (penalties, uneven))


def test_lookup_acceptance_replays_what_lookup_would_draft():
    """Calibration's replay of lookup over a teacher-forced continuation (T = 0: p is the argmax)."""
    from selfspec.calibration.calibrate import lookup_acceptance

    prompt, cont = [1, 2, 3, 4, 1, 2], [3, 4, 9]
    p = torch.nn.functional.one_hot(torch.tensor(cont), 10).float()
    assert lookup_acceptance(prompt, cont, p, gamma=3, ngram=3) == [[1.0, 1.0, 0.0], [1.0, 0.0], [0.0]]
    assert lookup_acceptance([5, 6], [7], torch.ones(1, 10), gamma=3, ngram=3) == [[]]  # nothing recurs
    # The lookup drafter's own shortest suffix (2): "6" alone recurs, which it does not draft from.
    assert lookup_acceptance([6, 8, 6], [8], p[:1], gamma=1, ngram=3) == [[]]
    assert lookup_acceptance([6, 8, 6], [8], torch.ones(1, 10), gamma=1, ngram=3, shortest=1) == [[1.0]]
    # The hybrid's replay: a whole trigram must recur ("4 1 2" does not; "1 2 3" and "2 3 4" do).
    assert lookup_acceptance(prompt, cont, p, gamma=3, ngram=3, shortest=3) == [[], [1.0, 0.0], [0.0]]


def test_hybrid_estimate_replays_whole_ngram_lookups_only():
    """Calibration predicts the hybrid from its own runs (whole n-grams), not lookup's backed-off ones:
    where only short suffixes recur, the hybrid is its int4 fallback."""
    from selfspec.calibration.calibrate import AcceptanceRecord, estimate_buckets

    rec = AcceptanceRecord("q", "c", 10, 0.0, {"int4": [1.0] * 8})
    rec.lookup = [[0.0]] * 8  # a one-token match everywhere, always wrong
    rec.hybrid = [[]] * 8  # no whole n-gram anywhere
    v = {"1": 1.1, "2": 1.2}
    est = estimate_buckets([rec], {"int4": 0.3, "lookup": 0.01}, {"int4": v, "lookup": v})[0]
    assert est.speedup["hybrid"] == pytest.approx(est.speedup["int4"])
    assert est.speedup["lookup"]["2"] < 1.0 < est.speedup["int4"]["2"]
