"""`selfspec bench`: a Spec-Bench-style table against peers, per category, measured in one run.

Methods: `plain` (selfspec, no speculation: the baseline), `selfspec` (the default configuration: the
profile's policy decides), `selfspec:N:G` (speculation forced at depth N, γ = G), `selfspec:D:G` (drafter
D = int4, int8, lookup or hybrid, γ = G), `hf` (transformers generate), `hf-early-exit` (transformers
`assistant_early_exit`, drafting with the same model's first layers), `hf-prompt-lookup` (transformers
`prompt_lookup_num_tokens`), `llama.cpp` (llama-cpp-python's plain decode of the default model's GGUF,
when installed). Greedy by default (`--temperature` samples; peers then sample with their own RNG);
every method runs on each prompt before the next prompt, in an order that rotates. Speedup = plain
time / method time. Mean accepted tokens = tokens per full-model forward (1 for plain decoding)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from selfspec.data import DEV_SET

from .calibrate import heldout_ids, load_questions
from .common import (
    ArgumentParser,
    add_draft_head_args,
    add_model_args,
    draft_head_arg,
    engine_from_args,
    positive_int,
    run,
)

PROG = "selfspec bench"
HF_METHODS = ("hf", "hf-early-exit", "hf-prompt-lookup")
PEERS = (*HF_METHODS, "llama.cpp")
MODEL_DRAFTERS = ("int4", "int8", "lookup", "hybrid")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Speedup over plain decoding per category, against transformers peers.")
    add_model_args(p)
    p.add_argument(
        "--data",
        default=str(DEV_SET),
        help="JSONL with question_id, category, turns (Spec-Bench format; default: the shipped Spec-Bench dev half)",
    )
    p.add_argument("--compare", default="plain,selfspec,hf,hf-early-exit,hf-prompt-lookup")
    p.add_argument("--per-category", type=positive_int, default=1)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every method (default 0)")
    p.add_argument("--repeats", type=positive_int, default=1, help="timings per method and prompt; the median is kept")
    p.add_argument("--early-exit-layers", type=positive_int, default=None, help="hf-early-exit depth (default: L/2)")
    p.add_argument("--prompt-lookup-tokens", type=positive_int, default=10)
    p.add_argument("--profile", help="calibration profile for the `selfspec` method")
    add_draft_head_args(p)
    p.add_argument(
        "--heldout-only",
        action="store_true",
        help="only prompts the draft head's training held out (from its metadata); --per-category applies after",
    )
    p.add_argument("--out", default="benchmarks/results/bench", help="path prefix for .json, .md and .png")
    p.add_argument("--json", action="store_true")
    return p


def parse_methods(text: str, num_layers: int | None = None) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m in ("plain", "selfspec") or m in PEERS:
            continue
        parts = m.split(":")
        plain_exit = len(parts) == 4 and parts[3] == "exit"
        source = len(parts) > 1 and (parts[1].isdigit() or (parts[1] in MODEL_DRAFTERS and not plain_exit))
        if parts[0] != "selfspec" or len(parts) != 3 + plain_exit or not source or not parts[2].isdigit():
            raise ValueError(
                f"--compare: unknown method {m!r}; use plain, selfspec, selfspec:N:G, "
                f"selfspec:N:G:exit (no draft head), selfspec:D:G (D: {', '.join(MODEL_DRAFTERS)}), " + ", ".join(PEERS)
            )
    if "plain" not in methods:
        methods.insert(0, "plain")  # the baseline every speedup is taken against
    return methods


class Run(NamedTuple):
    """One method's run on one prompt."""

    tokens: list[int]
    seconds: float  # wall time, prompt included
    forwards: int  # full-model forwards
    policy: str  # the selfspec policy's decision ("" for peers)
    decode_seconds: float | None = None  # after the prompt's prefill (selfspec methods; None for peers)


class Runner:
    """Runs one method on one prompt -> Run."""

    def __init__(self, engine, args) -> None:
        self.engine = engine
        self.args = args
        self._hf = None
        self._llama = None
        self._forwards = 0

    def hf_model(self):
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = (
                AutoModelForCausalLM.from_pretrained(str(self.engine.checkpoint_dir), dtype=self.engine.model.dtype)
                .to(self.engine.device)
                .eval()
            )
            self._hf.generation_config.eos_token_id = None  # every method generates exactly max_tokens
            self._hf.generation_config.pad_token_id = 0
            last = self._hf.model.layers[-1]  # only full-model forwards reach the last layer
            last.register_forward_hook(lambda *a: setattr(self, "_forwards", self._forwards + 1))
        return self._hf

    def __call__(self, method: str, ids: list[int], category: str | None = None):
        from selfspec import SamplingParams, SpecConfig

        t = self.args.temperature
        params = SamplingParams(temperature=t, max_tokens=self.args.max_tokens, ignore_eos=True, seed=0)
        if method in HF_METHODS:
            return self._hf_run(method, ids)
        if method == "llama.cpp":
            return self._llama_run(ids)
        parts = method.split(":")
        if method in ("plain", "selfspec"):
            speculation = None if method == "plain" else "auto"
        elif not parts[1].isdigit():  # selfspec:D:G, a drafter over the full depth
            speculation = SpecConfig(None, int(parts[2]), parts[1])
        else:  # selfspec:N:G, or selfspec:N:G:exit for the plain early exit at a depth that has a draft head
            speculation = SpecConfig(int(parts[1]), int(parts[2]), "exit" if parts[-1] == "exit" else "auto")
        start = time.perf_counter()
        r = self.engine.generate(ids, params, speculation=speculation, category=category)
        seconds = time.perf_counter() - start
        rounds = r.stats.steps  # plain steps and speculative rounds each run the full model once
        return Run(r.token_ids, seconds, rounds, r.stats.spec_policy, r.stats.decode_seconds)

    def _hf_run(self, method: str, ids: list[int]):
        import torch

        model = self.hf_model()
        kwargs = {}
        if method == "hf-early-exit":
            kwargs["assistant_early_exit"] = self.args.early_exit_layers or self.engine.model.num_layers // 2
        elif method == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.args.prompt_lookup_tokens
        if self.args.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.args.temperature, top_k=0)
            torch.manual_seed(0)
        else:
            kwargs.update(do_sample=False)
        self._forwards = 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=self.engine.device), max_new_tokens=self.args.max_tokens, **kwargs
            )
        seconds = time.perf_counter() - start
        return Run(out[0, len(ids) :].tolist(), seconds, max(self._forwards, 1), "")

    def _llama_run(self, ids: list[int]):
        """llama.cpp's plain decode of the default model's GGUF (its own 4-bit kernels, flash attention)."""
        import torch

        if self._llama is None:
            try:
                from llama_cpp import Llama
            except ImportError:
                raise ValueError("--compare llama.cpp: llama-cpp-python is not installed (pip install '.[bench]')")
            from selfspec.model.loader import default_gguf_path

            if self.args.model != "default":
                raise ValueError("--compare llama.cpp runs the default model's GGUF: use --model default")
            self._llama = Llama(
                model_path=str(default_gguf_path()),
                n_threads=torch.get_num_threads(),
                n_ctx=self.engine.max_model_len,
                flash_attn=True,
                verbose=False,
                seed=0,
            )
        t = self.args.temperature
        out = []
        start = time.perf_counter()
        # generate(reset=True) alone keeps the longest cached prefix of the previous call's tokens: a
        # repeated prompt skipped its prefill, which selfspec's runs never skip
        self._llama.reset()
        for token in self._llama.generate(ids, top_k=1 if t == 0 else 0, top_p=1.0, temp=t, reset=True):
            out.append(token)
            if len(out) == self.args.max_tokens:
                break
        return Run(out, time.perf_counter() - start, len(out), "")


def _body(args) -> int:

    methods = parse_methods(args.compare)
    engine = engine_from_args(args, profile=args.profile, draft_head=draft_head_arg(args))
    held = heldout_ids(engine) if args.heldout_only else None
    if args.heldout_only and not held:
        raise ValueError(
            "--heldout-only: no draft head with held-out prompts in its metadata (see selfspec train-draft)"
        )
    questions = load_questions(args.data, args.per_category, held)
    args.questions = [str(q["question_id"]) for q in questions]
    runner = Runner(engine, args)
    engine.preload()  # the quantized copies the default policy may pick, loaded outside the timings
    for m in methods:  # warm-up: a method's first call builds its drafter or loads its peer
        runner(m, engine.encode("Hello"))
    encoded = [(q, engine.encode(q["turns"][0])) for q in questions]
    fits = [(q, ids) for q, ids in encoded if len(ids) + args.max_tokens <= engine.max_model_len]
    args.skipped = [q["question_id"] for q, ids in encoded if (q, ids) not in fits]
    if not fits:
        raise ValueError(
            f"no prompt fits the model's {engine.max_model_len}-token context with --max-tokens {args.max_tokens}"
        )
    rows = []
    for i, (q, ids) in enumerate(fits):
        runs: dict[str, list[Run]] = {}
        for r in range(args.repeats):  # every method once per repeat, in an order that rotates
            shift = (i + r) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                runs.setdefault(m, []).append(runner(m, ids, q["category"]))
        results = {m: _median(rs) for m, rs in runs.items()}
        plain = results["plain"]
        for m in methods:
            run = results[m]
            decoding = None if run.decode_seconds is None else plain.decode_seconds / run.decode_seconds
            rows.append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "method": m,
                    "seconds": run.seconds,
                    "tokens_per_second": len(run.tokens) / run.seconds,
                    "speedup": plain.seconds / run.seconds,
                    "decode_seconds": run.decode_seconds,
                    "decode_speedup": decoding,  # prefill excluded: the part speculation changes
                    "mean_accepted_tokens": len(run.tokens) / run.forwards,
                    "identical_to_plain": run.tokens == plain.tokens,
                    "spec_policy": run.policy,
                }
            )
        print(
            f"{q['category']:15s} " + "  ".join(f"{m} {plain.seconds / results[m].seconds:.2f}x" for m in methods),
            flush=True,
        )
    summary = _summarize(rows, methods)
    _write(Path(args.out), args, engine, methods, rows, summary)
    if args.json:
        print(json.dumps(summary))
    return 0


def _median(runs: list[Run]) -> Run:
    """The first run's tokens, forwards and policy with the median of the timings."""
    decode = [r.decode_seconds for r in runs if r.decode_seconds is not None]
    seconds = statistics.median(r.seconds for r in runs)
    return runs[0]._replace(seconds=seconds, decode_seconds=statistics.median(decode) if decode else None)


def _summarize(rows: list[dict], methods: list[str]) -> list[dict]:
    out = []
    for category in sorted({r["category"] for r in rows}) + ["all"]:
        for m in methods:
            sel = [r for r in rows if r["method"] == m and category in ("all", r["category"])]
            out.append(
                {
                    "category": category,
                    "method": m,
                    "speedup": statistics.median(r["speedup"] for r in sel),
                    "decode_speedup": statistics.median(d) if (d := _decoding(sel)) else None,
                    "mean_accepted_tokens": statistics.fmean(r["mean_accepted_tokens"] for r in sel),
                    "identical": sum(r["identical_to_plain"] for r in sel),
                    "prompts": len(sel),
                }
            )
    return out


def _decoding(rows: list[dict]) -> list[float]:
    return [r["decode_speedup"] for r in rows if r["decode_speedup"] is not None]


def _write(prefix: Path, args, engine, methods, rows, summary) -> None:
    import torch

    from selfspec.calibration.calibrate import machine_info

    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine_info(),
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "heldout_only": args.heldout_only,
        "questions": args.questions,
        "repeats": args.repeats,
        "methods": methods,
        "draft_heads": {str(n): {"kind": h.kind, "vocab_subset": h.vocab_subset} for n, h in engine.heads.items()},
        "spec_policy_examples": sorted({r["spec_policy"] for r in rows if r["method"] == "selfspec"}),
        "skipped_prompts_too_long": args.skipped,
    }
    prefix.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    cats = sorted({s["category"] for s in summary if s["category"] != "all"}) + ["all"]
    get = {(s["category"], s["method"]): s for s in summary}
    lines = [
        f"# selfspec bench: speedup over plain decoding ({args.model}, {args.dtype}, "
        f"{'greedy' if args.temperature == 0 else f'T={args.temperature:g}'}, {args.max_tokens} tokens)",
        "",
        f"Cells: median speedup over selfspec plain decoding (measured interleaved in one run, median of "
        f"{args.repeats} timing(s) per method and prompt) / mean tokens per full-model forward / prompts whose "
        "output is identical to plain decoding.",
        "",
        f"Machine: {meta['machine']['cpu']} ({meta['machine']['capability']}), {meta['machine']['platform']}, "
        f"{meta['machine']['cores']} cores, "
        f"{meta['threads']} torch threads, torch {meta['machine']['torch']}.",
        "",
        "| category | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for c in cats:
        cells = [
            f"{get[c, m]['speedup']:.2f}x / {get[c, m]['mean_accepted_tokens']:.2f} / "
            f"{get[c, m]['identical']}/{get[c, m]['prompts']}"
            for m in methods
        ]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    ours = [m for m in methods if get["all", m]["decode_speedup"] is not None]
    lines += [
        "",
        "Decoding only (the prompt's prefill, the same work for every selfspec method, left out): median "
        "speedup over plain decoding.",
        "",
        "| category | " + " | ".join(ours) + " |",
        "|---|" + "---|" * len(ours),
    ]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{get[c, m]['decode_speedup']:.2f}x" for m in ours) + " |")
    if meta["spec_policy_examples"]:
        lines += ["", "The `selfspec` default configuration's policy decisions:", ""]
        lines += [f"- {p}" for p in meta["spec_policy_examples"]]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(prefix.with_suffix(".png"), cats, methods, get)


def _plot(path: Path, cats, methods, get) -> None:
    from selfspec.calibration.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar([i + j * width for i in range(len(cats))], [get[c, m]["speedup"] for c in cats], width, label=m)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return run(PROG, build_parser(), argv, _body)
