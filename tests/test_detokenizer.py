from selfspec.decoding.detokenizer import TextStream


def stream(tokenizer, text: str, stop=()):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    s = TextStream(tokenizer, [1], stop)
    pieces = []
    for t in ids:
        pieces.append(s.push(t))
        if s.stopped:
            break
    pieces.append(s.flush())
    return pieces, s


def test_deltas_concatenate_to_decoded_text(default_engine):
    tok = default_engine.tokenizer
    text = "Héllo wörld 👋🏽 — naïve café, 東京."
    pieces, s = stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_string_across_tokens_is_cut_and_never_shown(default_engine):
    tok = default_engine.tokenizer
    pieces, s = stream(tok, "The answer is 42. END OF ANSWER and more text", stop=("END OF",))
    assert s.stopped
    assert "".join(pieces) == "The answer is 42. "
    assert not any("END" in p for p in pieces)


def test_no_stop_match_keeps_everything(default_engine):
    tok = default_engine.tokenizer
    pieces, s = stream(tok, "alpha beta gamma", stop=("delta",))
    assert not s.stopped and "".join(pieces) == "alpha beta gamma"
