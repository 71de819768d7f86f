"""Trained draft heads: save/load and fingerprint checks, losslessness with an adapter and a reduced
vocabulary (greedy exact, sampled distribution), and a training smoke run that must lower the
held-out loss."""

import pytest
import torch

from selfspec import Engine, SamplingParams, SelfspecError, SpecConfig
from selfspec.draft_head import Adapter, build, load
from selfspec.distribution import sample_continuations
from selfspec.train_draft import TrainConfig, prepare_data, train_one

from .conftest import tiny_hf_model
from .test_model_parity import ours
from .test_speculative import VOCAB, exact_joint


def random_adapter(kind: str, hidden: int, seed: int = 0) -> Adapter:
    torch.manual_seed(seed)
    a = Adapter(kind, hidden, rank=16)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.05)
    return a


def test_save_load_round_trip_and_fingerprint(tmp_path, tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    head = build(engine.model, 2, random_adapter("mlp", 64), torch.arange(0, 49152, 7), {"training_command": "test"})
    head.save(tmp_path / "h.safetensors")
    again = load(tmp_path / "h.safetensors", engine.model)
    assert again.kind == "mlp" and again.draft_layers == 2 and torch.equal(again.vocab, head.vocab)
    assert again.metadata["training_command"] == "test" and again.metadata["base_fingerprint"] == engine.model.fingerprint
    h = torch.randn(3, 64)
    assert torch.equal(again.logits(h), head.logits(h))
    assert torch.isinf(head.logits(h)[:, 1]).all()  # token 1 is outside the subset: q = 0 there
    other = ours(tiny_hf_model("llama", vocab_size=49152, seed=9))
    with pytest.raises(SelfspecError, match="was trained for model .* not this one"):
        load(tmp_path / "h.safetensors", other)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(SelfspecError, match="cannot read draft head"):
        load(tmp_path / "junk.safetensors", engine.model)


@pytest.mark.parametrize("kind", ["affine", "mlp"])
def test_greedy_exact_with_adapter_and_reduced_vocab(tiny_checkpoint, kind):
    plain_engine = Engine.from_pretrained(str(tiny_checkpoint))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    head = build(plain_engine.model, 2, random_adapter(kind, 64, seed=3), torch.arange(0, 49152, 3))
    engine = Engine.from_pretrained(str(tiny_checkpoint), draft_head=head)
    for prompt in ("hello", "The quick brown fox"):
        plain = plain_engine.generate(prompt, greedy, spec=None)
        spec = engine.generate(prompt, greedy, spec=SpecConfig(2, 3))
        assert spec.token_ids == plain.token_ids and spec.stats.spec.rounds > 0


@torch.inference_mode()
def test_sampled_distribution_exact_with_adapter_and_reduced_vocab(small_vocab_model):
    """A reduced vocabulary that leaves out tokens the target likes, and a random adapter: the
    first two sampled tokens still follow the exact joint (chi-square, 1e-4 level, fixed seeds)."""
    from scipy import stats

    model, prompt, n = small_vocab_model, [1, 5, 7, 2], 20_000
    params = SamplingParams(temperature=1.0)
    head = build(model, 1, random_adapter("affine", 64, seed=5), torch.tensor([0, 2, 3, 5, 8, 11]))
    joint = exact_joint(model, prompt, params).double()
    cache = model.new_cache(150_000, block_size=4)
    samples = sample_continuations(model, cache, prompt, params, SpecConfig(1, 2), n, 2, seed=4, chunk=5000, draft_logits=head.logits)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in samples:
        counts[a, b] += 1
    expected = (joint * n).flatten()
    big = expected >= 5
    obs, exp = counts.flatten()[big], expected[big]
    if expected[~big].sum() > 0:
        obs = torch.cat([obs, counts.flatten()[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    assert stats.chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-4


def test_training_smoke_lowers_heldout_loss(tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    prompts = [engine.encode(f"Question {i}: what is {i} plus {i}?") for i in range(24)]
    cfg = TrainConfig(draft_layers=[2], kinds=["mlp"], vocab_subset=0, rank=64, steps=200, batch_size=128, lr=3e-3, new_tokens=24, prompt_positions=32)
    data = prepare_data(engine.model, prompts, set(engine.eos_token_ids), cfg, log=lambda m: None)
    r = train_one(engine.model, 2, "mlp", data, cfg, {"test": True})
    assert r.heldout["loss"] < r.baseline["loss"] - 0.05, (r.baseline, r.heldout)
    assert r.heldout["positions"] > 0 and 0 <= r.heldout["acceptance"]["0"] <= 1
    again = train_one(engine.model, 2, "mlp", data, cfg, {"test": True})  # deterministic with the seed
    assert again.heldout == r.heldout
