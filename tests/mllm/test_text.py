import json
import random

import pytest

from mllm import UserError
from mllm.config import TokenizerConfig
from mllm.data.text import build_tokenizer, read_chunks, strip_gutenberg, tokenizer_from_json

WORDS = [
    "the",
    "prince",
    "said",
    "Andrew",
    "war",
    "peace",
    "Moscow",
    "and",
    "of",
    "to",
    "it's",
    "don't",
    "(quietly)",
    '"yes"',
    "3",
    "1812",
    "naïve",
    "Über",
    "—",
    "<br />",
    "x<br",
    "<BR />y",
    "so<br />on",
    "no\xa0break",
    "sep!\x1c\x1c",
]
PUNCT = [".", ",", ";", ":", "!", "?", "-", "..."]
SPACES = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\n \n", "\t", "   \n"]


def make_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        if rng.random() < 0.2:
            out.append(rng.choice(PUNCT))
        out.append(rng.choice(SPACES))
    return "".join(out)


def chunkings(text: str, seed: int = 0):
    """The text cut every n characters for small n, and at random places."""
    for n in (1, 2, 3, 7):
        yield [text[i : i + n] for i in range(0, len(text), n)]
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(20, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def flat(token_lists):
    return [t for tokens in token_lists for t in tokens]


def gutenberg(body: str) -> str:
    return (
        "The Project Gutenberg eBook of Something\n\nLicence text *** not a marker\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK SOMETHING ***\n"
        + body
        + "*** END OF THE PROJECT GUTENBERG EBOOK SOMETHING ***\n\nMore licence text.\n"
    )


@pytest.fixture(scope="module")
def bpe():
    text = make_text(3000, seed=1)
    return build_tokenizer(TokenizerConfig(kind="bpe", bpe_vocab_size=300), lambda: [text])


# -- reading ------------------------------------------------------------------------------------


def test_read_chunks_universal_newlines_across_any_chunk_size(tmp_path):
    raw = "one\r\ntwo\rthree\n\r\nfour é☃\r\r\n".encode()
    path = tmp_path / "t.txt"
    path.write_bytes(raw)
    for n in range(1, len(raw) + 2):
        assert "".join(read_chunks(str(path), chunk_chars=n)) == "one\ntwo\nthree\n\nfour é☃\n\n"


def test_read_chunks_drops_byte_order_mark(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffHello\r\n".encode())
    assert "".join(read_chunks(str(path), chunk_chars=2)) == "Hello\n"


def test_read_chunks_non_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"plain ascii text " * 10 + "caf\xe9 au lait".encode("latin-1"))
    for n in (1, 3, 4, 1 << 20):  # the bad byte alone, last, inside and in one read
        with pytest.raises(UserError, match=r"not UTF-8.*offset 173\b"):
            "".join(read_chunks(str(path), chunk_chars=n))


def test_read_chunks_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no text file at .*nope.txt"):
        list(read_chunks(str(tmp_path / "nope.txt")))


# -- Project Gutenberg --------------------------------------------------------------------------


def test_strip_gutenberg_keeps_only_the_book_for_any_chunking():
    body = "\nCHAPTER I\n\nIt was *** END OF nothing *** mid-line.\nThe end.\n\n"
    text = gutenberg(body)
    assert "".join(strip_gutenberg([text])) == body
    for chunks in chunkings(text):
        assert "".join(strip_gutenberg(chunks)) == body


def test_strip_gutenberg_passes_text_without_start_marker_unchanged():
    text = "Just a text.\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nstill here\n"
    assert "".join(strip_gutenberg(text[i : i + 5] for i in range(0, len(text), 5))) == text
    long = make_text(40_000, seed=3)  # longer than the header we look for a START line in
    assert "".join(strip_gutenberg([long[:70_000], long[70_000:]])) == long


def test_strip_gutenberg_without_end_marker_keeps_the_rest():
    text = "header\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\nbody\n"
    assert "".join(strip_gutenberg(list(text))) == "body\n"


# -- character tokenizer ------------------------------------------------------------------------


def test_char_normalize_rules():
    tok = build_tokenizer(TokenizerConfig(kind="char", normalize=True))
    text = "Well,  Prince (so) —\n\nGenoa & Lucca: 1805?!\n \n Yes-no; é.\t"
    expected = "Well, Prince so Genoa Lucca 1805?! Yes-no; ."
    assert "".join(flat(tok.tokenize([text]))) == expected
    assert all(len(t) == 1 for t in flat(tok.tokenize([text])))


def test_char_normalisation_counts_what_it_drops_by_character_for_any_chunking():
    from collections import Counter

    text = make_text(400, seed=3) + "def f(x_1):\n    return {'é': x_1 == 2}\n"
    for chunks in chunkings(text):
        tok = build_tokenizer(TokenizerConfig(kind="char", normalize=True))
        out = "".join(token for arr in tok.token_arrays(chunks) for token in arr.to_pylist())
        chars, lost = tok.take_loss()
        read, made = Counter(text), Counter(out)
        want = {c: read[c] - made[c] for c in read if ord(c) < 128 and read[c] > made[c]}
        want["non-ASCII"] = sum(n for c, n in read.items() if ord(c) >= 128)
        assert (chars, lost) == (len(text), want)
        assert tok.take_loss() == (0, {})  # counted from the last call on
    assert build_tokenizer(TokenizerConfig(kind="char", normalize=False)).take_loss() is None


def test_char_raw_mode_keeps_everything():
    tok = build_tokenizer(TokenizerConfig(kind="char", normalize=False))
    text = make_text(300) + "\r\t☃"
    tokens = flat(tok.tokenize([text]))
    assert tokens == list(text)
    assert tok.detokenize(tokens) == text


def test_char_split_normalises_a_prompt_as_the_corpus_was():
    """A prompt loses what the corpus lost (so ':' or "'" cannot be refused by a model whose
    corpus had them normalised away); without normalisation it keeps every character."""
    tok = build_tokenizer(TokenizerConfig(kind="char", normalize=True))
    text = "Hé  said:\r\n\n'(x)'"
    assert tok.split(text) == flat(tok.tokenize([text])) == list("H said x")
    raw = build_tokenizer(TokenizerConfig(kind="char", normalize=False))
    assert raw.split(text) == list(text)


# -- word tokenizer -----------------------------------------------------------------------------


def test_word_tokenizer_basic_english():
    tok = build_tokenizer(TokenizerConfig(kind="word", normalize=True))
    text = 'Hello, World! It\'s "fine" (really);<br />Yes: NO?\n\n  End.'
    assert flat(tok.tokenize([text])) == [
        "hello",
        ",",
        "world",
        "!",
        "it",
        "'",
        "s",
        '"',
        "fine",
        '"',
        "(",
        "really",
        ")",
        ";",
        "yes",
        ":",
        "no",
        "?",
        "end",
        ".",
    ]
    assert tok.split("The  Prince.") == ["the", "prince", "."]


def test_word_raw_mode_keeps_case_and_markup():
    tok = build_tokenizer(TokenizerConfig(kind="word", normalize=False))
    assert tok.split("The <br />Prince, Andrew.") == ["The", "<br", "/>Prince", ",", "Andrew", "."]


def test_word_detokenize_tidies_spaces_before_punctuation():
    tok = build_tokenizer(TokenizerConfig(kind="word"))
    assert tok.detokenize(["well", ",", "prince", "(", "so", ")", "!"]) == "well, prince (so)!"


# -- every tokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,normalize", [("char", True), ("char", False), ("word", True), ("word", False), ("bpe", True)]
)
def test_same_tokens_for_any_chunking(kind, normalize, bpe):
    tok = bpe if kind == "bpe" else build_tokenizer(TokenizerConfig(kind=kind, normalize=normalize))
    text = make_text(400, seed=2)
    whole = flat(tok.tokenize([text]))
    assert whole
    for chunks in chunkings(text, seed=4):
        assert flat(tok.tokenize(chunks)) == whole


def test_pipeline_invariant_to_crlf_and_marker_split_across_chunks(tmp_path):
    body = make_text(200, seed=5) + "\n"
    path = tmp_path / "book.txt"
    path.write_bytes(gutenberg(body).replace("\n", "\r\n").encode())
    for normalize in (True, False):
        tok = build_tokenizer(TokenizerConfig(kind="char", normalize=normalize))
        want = flat(tok.tokenize([body]))
        for n in (1, 2, 5, 64, 1 << 20):
            assert flat(tok.tokenize(strip_gutenberg(read_chunks(str(path), chunk_chars=n)))) == want


def test_bpe_learns_merges_and_round_trips(bpe):
    text = make_text(500, seed=9) + " unseen: ☃ ß 你好\r\n"
    tokens = flat(bpe.tokenize([text]))
    assert bpe.detokenize(tokens) == text
    assert len(tokens) < 0.7 * len(text.encode())  # merges learned from the training text
    assert bpe.split("prince") == ["prince"]
    assert len(bpe.hf.get_vocab()) == 300


def test_bpe_encodes_long_text_in_pieces_with_the_same_tokens(bpe, monkeypatch):
    text = make_text(400, seed=7)
    monkeypatch.setattr(bpe, "_PIECE", 16)  # many pieces per chunk, as a long corpus gets
    assert flat(bpe.tokenize([text])) == bpe.hf.encode(text).tokens


def test_bpe_fast_encoder_gives_hugging_faces_ids_on_a_book():
    """The tokenize stage encodes with tiktoken over the BPE's own merges (five times faster);
    the ids must be Hugging Face's, accents, dashes and digits included."""
    from textdata import SHARED_DATA

    book = SHARED_DATA / "warandpeace.txt"
    if not book.exists():
        pytest.skip("the shared books are not beside the repository")
    text = book.read_text(encoding="utf-8")
    tok = build_tokenizer(TokenizerConfig(kind="bpe", bpe_vocab_size=2000), lambda: [text[:600_000]])
    other = text[1_000_000:1_600_000] + make_text(2000, seed=3) + " unseen: ☃ ß 你好\r\n"
    ids = tok._ids(other)
    assert tok._encoder.tiktoken is not None  # the fast path ran, and agreed on its first piece
    assert len(other) > 600_000 and ids.tolist() == tok.hf.encode(other).ids


def test_bpe_fast_encoder_falls_back_where_tiktoken_would_differ():
    """A BPE whose merges tiktoken's rule would not follow (b+c before a+b, then ab+c: Hugging
    Face leaves "abc" as a|bc, tiktoken would join it): the encoder notices on its first text and
    keeps Hugging Face's ids."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    from mllm.data.fastbpe import FastEncoder

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    hf = HF(models.BPE(vocab=vocab, merges=[("b", "c"), ("a", "b"), ("ab", "c")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    enc = FastEncoder(hf)
    assert enc.tiktoken is not None
    assert [ids.tolist() for ids in enc.encode(["abc abc"])] == [hf.encode("abc abc").ids]
    assert hf.encode("abc").ids == [vocab["a"], 256]
    assert enc.tiktoken is None  # and it stays on Hugging Face from then on
    assert enc.encode(["xabc"])[0].tolist() == hf.encode("xabc").ids


def test_bpe_training_is_deterministic(bpe):
    text = make_text(3000, seed=1)
    again = build_tokenizer(TokenizerConfig(kind="bpe", bpe_vocab_size=300), lambda: iter([text]))
    assert again.to_json() == bpe.to_json()


@pytest.mark.parametrize(
    "kind,normalize", [("char", True), ("char", False), ("word", True), ("word", False), ("bpe", True)]
)
def test_tokenizer_json_round_trip(kind, normalize, bpe):
    tok = bpe if kind == "bpe" else build_tokenizer(TokenizerConfig(kind=kind, normalize=normalize))
    s = tok.to_json()
    assert json.loads(s)["kind"] == kind
    again = tokenizer_from_json(s)
    text = make_text(200, seed=6)
    assert (again.kind, again.normalize) == (kind, normalize)
    assert flat(again.tokenize([text])) == flat(tok.tokenize([text]))
    assert again.detokenize(again.split(text[:50])) == tok.detokenize(tok.split(text[:50]))
    assert again.to_json() == s


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        "[1, 2]",
        '{"format": "mllm-vocab"}',
        '{"format": "mllm-tokenizer", "version": 9, "kind": "char"}',
        '{"format": "mllm-tokenizer", "version": 1, "kind": "morse"}',
        '{"format": "mllm-tokenizer", "version": 1, "kind": "bpe", "hf_tokenizer": {"model": 3}}',
    ],
)
def test_tokenizer_from_json_rejects_other_input(bad):
    with pytest.raises(UserError):
        tokenizer_from_json(bad)


def test_bpe_needs_training_text():
    with pytest.raises(ValueError, match="training"):
        build_tokenizer(TokenizerConfig(kind="bpe"))
