"""Trained draft heads: save/load and fingerprint checks, losslessness with an adapter and a reduced
vocabulary (greedy exact, sampled distribution), and a training smoke run that must lower the
held-out loss."""

import pytest
import torch

from selfspec import Engine, SamplingParams, SelfspecError, SpecConfig
from selfspec.calibration.distill import TrainConfig, prepare_data, train_one
from selfspec.calibration.distribution import sample_continuations
from selfspec.decoding.head import Adapter, HeadDrafter, build, load, new_adapter

from .conftest import tiny_hf_model
from .test_model_parity import ours
from .test_speculative import VOCAB, exact_joint


def random_adapter(model, kind: str, seed: int = 0) -> Adapter:
    torch.manual_seed(seed)
    a = new_adapter(model, kind, rank=16)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.05)
    return a


def test_save_load_round_trip_and_fingerprint(tmp_path, tiny_checkpoint):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    head = build(
        engine.model, 2, random_adapter(engine.model, "mlp"), torch.arange(0, 49152, 7), {"training_command": "test"}
    )
    head.save(tmp_path / "h.safetensors")
    again = load(tmp_path / "h.safetensors", engine.model)
    assert again.kind == "mlp" and again.draft_layers == 2 and torch.equal(again.vocab, head.vocab)
    assert (
        again.metadata["training_command"] == "test" and again.metadata["base_fingerprint"] == engine.model.fingerprint
    )
    h = torch.randn(3, 64)
    assert torch.equal(again.logits(h), head.logits(h))
    assert torch.isinf(head.logits(h)[:, 1]).all()  # token 1 is outside the subset: q = 0 there
    other = ours(tiny_hf_model("llama", vocab_size=49152, seed=9))
    with pytest.raises(SelfspecError, match="was trained for model .* not this one"):
        load(tmp_path / "h.safetensors", other)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(SelfspecError, match="cannot read draft head"):
        load(tmp_path / "junk.safetensors", engine.model)


@pytest.mark.parametrize("kind", ["affine", "mlp", "attn"])
def test_greedy_exact_with_adapter_and_reduced_vocab(tiny_checkpoint, kind):
    plain_engine = Engine.from_pretrained(str(tiny_checkpoint))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    head = build(plain_engine.model, 2, random_adapter(plain_engine.model, kind, seed=3), torch.arange(0, 49152, 3))
    engine = Engine.from_pretrained(str(tiny_checkpoint), draft_head=head)
    for prompt in ("hello", "The quick brown fox"):
        plain = plain_engine.generate(prompt, greedy, speculation=None)
        spec = engine.generate(prompt, greedy, speculation=SpecConfig(2, 3))
        assert spec.token_ids == plain.token_ids and spec.stats.spec.rounds > 0


@pytest.mark.parametrize("kind", ["affine", "attn"])
@torch.inference_mode()
def test_sampled_distribution_exact_with_adapter_and_reduced_vocab(small_vocab_model, kind):
    """A reduced vocabulary that leaves out tokens the target likes, and a random adapter: the
    first two sampled tokens still follow the exact joint (chi-square, 1e-4 level, fixed seeds)."""
    from scipy import stats

    model, prompt, n = small_vocab_model, [1, 5, 7, 2], 20_000
    params = SamplingParams(temperature=1.0)
    head = build(model, 1, random_adapter(model, kind, seed=5), torch.tensor([0, 2, 3, 5, 8, 11]))
    joint = exact_joint(model, prompt, params).double()
    cache = model.new_cache(150_000, block_size=4)
    samples = sample_continuations(
        model, cache, prompt, params, SpecConfig(1, 2), n, 2, seed=4, chunk=5000, drafter=HeadDrafter(head)
    )
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


@pytest.mark.parametrize("kind", ["mlp", "attn"])
def test_training_smoke_lowers_heldout_loss(tiny_checkpoint, kind):
    engine = Engine.from_pretrained(str(tiny_checkpoint))
    prompts = [engine.encode(f"Question {i}: what is {i} plus {i}?") for i in range(24)]
    cfg = TrainConfig(
        draft_layers=[2],
        kinds=[kind],
        vocab_subset=0,
        rank=64,
        steps=200,
        batch_size=128,
        lr=3e-3,
        new_tokens=24,
        prompt_positions=32,
    )
    data = prepare_data(engine.model, prompts, set(engine.eos_token_ids), cfg, log=lambda m: None)
    r = train_one(engine.model, 2, kind, data, cfg, {"test": True})
    assert r.heldout["loss"] < r.baseline["loss"] - 0.05, (r.baseline, r.heldout)
    assert r.heldout["positions"] > 0 and 0 <= r.heldout["acceptance"]["0"] <= 1
    again = train_one(engine.model, 2, kind, data, cfg, {"test": True})  # deterministic with the seed
    assert again.heldout == r.heldout


@torch.inference_mode()
def test_attn_draft_reads_the_same_context_as_training(tiny_checkpoint):
    """The attn head's drafting call (layer N-1's keys from the paged cache, after a prefill and with
    earlier rounds rolled back) equals its teacher-forced form that training and evaluation use."""
    from selfspec.calibration.distill import attn_context, collect

    model = Engine.from_pretrained(str(tiny_checkpoint)).model
    head = build(model, 2, random_adapter(model, "attn", seed=7), None)
    tokens = [5, 17, 3, 99, 42, 7, 8, 1000, 23, 4]
    data = collect(model, [(tokens, 0)], [2], keep_final=False, kv=True)
    reference = head.logits(data.hidden[2][None], attn_context(model, data, 2, 0, model.dtype))[0]  # [9, vocab]
    cache = model.new_cache(64, block_size=4)
    seq = cache.allocate()
    model.prefill(cache, seq, tokens[:5])
    model.prefill(cache, seq, [1, 2, 3])  # a rejected round's entries ...
    cache.truncate(seq, 5)  # ... rolled back by a length edit
    for i in range(5, 9):
        batch = cache.prepare([seq], [1])
        h = model.forward(torch.tensor([[tokens[i]]]), cache, end=2, batch=batch)
        torch.testing.assert_close(head.draft(h, batch, cache)[0], reference[i], rtol=1e-4, atol=1e-4)
        cache.truncate(seq, i)
        model.prefill(cache, seq, [tokens[i]])


def test_work_directory_refuses_other_settings(tmp_path):
    from selfspec.calibration.distill import _check_work_config

    cfg = TrainConfig(draft_layers=[2], kinds=["mlp"], vocab_subset=512)
    _check_work_config(tmp_path, cfg)
    _check_work_config(
        tmp_path, TrainConfig(draft_layers=[2, 3], kinds=["attn"], vocab_subset=512)
    )  # more N, kinds: fine
    with pytest.raises(SelfspecError, match="vocab_subset=512.*use another --out"):
        _check_work_config(tmp_path, TrainConfig(draft_layers=[2], kinds=["mlp"], vocab_subset=0))


def test_train_draft_cli(tiny_checkpoint, tmp_path, capsys):
    import json

    from selfspec.cli.main import main

    from .conftest import DEV_SET

    out = tmp_path / "head.safetensors"
    argv = [
        "train-draft",
        "--model",
        str(tiny_checkpoint),
        "--data",
        str(DEV_SET),
        "--max-prompts",
        "12",
        "--draft-layers",
        "1,2",
        "--kind",
        "affine,attn",
        "--steps",
        "20",
        "--batch-size",
        "64",
        "--new-tokens",
        "8",
        "--vocab-subset",
        "4096",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "train.png"),
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted((r["draft_layers"], r["kind"]) for r in report["results"]) == [
        (1, "affine"),
        (1, "attn"),
        (2, "affine"),
        (2, "attn"),
    ]
    assert all(r["choice"]["predicted_speedup"] > 0 and r["full_vocab"]["positions"] > 0 for r in report["results"])
    head = load(out, Engine.from_pretrained(str(tiny_checkpoint)).model)
    assert head.metadata["heldout_question_ids"] and "train-draft" in head.metadata["training_command"]
    assert (tmp_path / "train.png").stat().st_size > 0
    assert main(argv) == 0  # resumes: every head is already trained
    assert [r["heldout"] for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]] == [
        r["heldout"] for r in report["results"]
    ]
    assert main(argv[:-3] + ["--vocab-subset", "0", "--json"]) == 2  # other settings, same work directory
    assert "use another --out" in capsys.readouterr().err
    assert main(["train-draft", "--data", str(DEV_SET), "--kind", "lstm", "--out", str(out)]) == 2
