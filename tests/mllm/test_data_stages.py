"""The data logic in mllm: reading a source (encodings, Gutenberg books), token chunks in Parquet,
counting and splitting, without Prefect."""

from __future__ import annotations

import codecs
import hashlib
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mllm import UserError
from mllm.config import SplitConfig, TokenizerConfig
from mllm.data import corpus, splits, tokens
from mllm.data.text import build_tokenizer, read_chunks, strip_gutenberg
from mllm.data.vocab import Vocab

# Every case the char tokenizer's normalisation has to get right: CRLF and lone CR, runs of
# newlines and spaces (also across a dropped character), characters outside the kept set (ASCII
# punctuation, controls, tab), and non-ASCII of every UTF-8 length.
PIECES = [
    "Well",
    ",",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\r\n",
    "\r\n\r\n",
    "\r",
    " \n \n ",
    "\t",
    "(",
    ")",
    "&",
    "Prince",
    "1805",
    "?!",
    "-",
    ";",
    ".",
    "é",
    "naïve",
    "—",
    "☃",
    "😀",
    "\x0b",
    "\x7f",
    "~",
    " é ",
    "\n—\n",
    "Genoa",
    "and",
    "Lucca",
]


def special_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) for _ in range(n))


def reference_char_tokens(text: str) -> list[str]:
    """The char tokenizer's rules, as plainly as they can be written (its implementation before
    it worked on bytes): universal newlines, keep [A-Za-z0-9 \\-.;,\\n?!], runs of spaces and
    newlines -> one space."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[^A-Za-z0-9 \-.;,\n?!]+", "", text)
    return list(re.sub(r"[ \n]+", " ", text))


def cut(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), 30))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# -- char tokenizer against the reference ------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_char_tokens_equal_the_reference_for_any_chunking(seed: int, tmp_path: Path) -> None:
    text = special_text(3000, seed)
    want = reference_char_tokens(text)
    assert len(want) > 1000 and " " in want and "\n" not in want
    tok = build_tokenizer(TokenizerConfig(kind="char"))
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    rng = random.Random(seed)
    for n in (1, 2, 3, 5, 64, 1 << 20):
        chunks = list(read_chunks(str(path), chunk_chars=n))
        assert [t for arr in tok.token_arrays(chunks) for t in arr.to_pylist()] == want
        assert [t for ts in tok.tokenize(chunks) for t in ts] == want
    chunks = cut(text.replace("\r\n", "\n").replace("\r", "\n"), rng)
    assert [t for arr in tok.token_arrays(chunks) for t in arr.to_pylist()] == want


def test_char_raw_mode_arrays_hold_every_character() -> None:
    tok = build_tokenizer(TokenizerConfig(kind="char", normalize=False))
    text = special_text(2000, 3)
    chunks = cut(text, random.Random(3))
    arrays = list(tok.token_arrays(chunks))
    assert [t for a in arrays for t in a.to_pylist()] == list(text)
    assert [t for ts in tok.tokenize(chunks) for t in ts] == list(text)


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_token_arrays_equal_token_lists(kind: str) -> None:
    text = special_text(3000, 4).replace("\r", "")
    cfg = TokenizerConfig(kind=kind, bpe_vocab_size=300)
    tok = build_tokenizer(cfg, lambda: [text])
    chunks = cut(text, random.Random(4))
    lists = [t for ts in tok.tokenize(chunks) for t in ts]
    assert lists and [t for a in tok.token_arrays(chunks) for t in a.to_pylist()] == lists


# -- Parquet chunks, counting, splitting ---------------------------------------------------------


@pytest.mark.parametrize("kind,normalize", [("char", True), ("char", False), ("word", True), ("bpe", True)])
def test_token_chunks_round_trip_and_count(kind: str, normalize: bool, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tokens, "ROW_GROUP_CHUNKS", 3)  # several row groups from a small text
    text = special_text(6000, 5)
    raw = tmp_path / "raw.txt"
    raw.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(tokens, "CHUNK_CHARS", 1000)
    cfg = TokenizerConfig(kind=kind, normalize=normalize, bpe_vocab_size=300, strip_gutenberg=False)
    out = tmp_path / "tokens"
    out.mkdir()
    tok, n_tokens, n_chunks = tokens.tokenize_text(str(raw), cfg, str(out))
    want = [t for ts in tok.tokenize(read_chunks(str(raw))) for t in ts]
    table = pq.read_table(out / tokens.FILE)
    assert table.schema.field("tokens").type == pa.list_(pa.string())  # what other readers see
    assert table.column("chunk").to_pylist() == list(range(n_chunks))
    assert [t for row in table.column("tokens").to_pylist() for t in row] == want
    assert n_tokens == len(want) and n_chunks > 3
    assert tokens.count_tokens(str(out)) == Counter(want)
    vocab = Vocab.build(Counter(want[: len(want) // 2]))  # some tokens unknown
    ids = np.concatenate([vocab.encode_array(b) for b in tokens.token_batches(str(out))])
    assert ids.tolist() == vocab.encode(want)


def test_no_tokens_left_is_a_user_error(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text("(((«»)))~", encoding="utf-8")
    out = tmp_path / "tokens"
    out.mkdir()
    with pytest.raises(UserError, match="no tokens left .*normalize=false"):
        tokens.tokenize_text(str(raw), TokenizerConfig(kind="char"), str(out))


def test_write_splits_routes_every_token_once(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(special_text(5000, 6), encoding="utf-8")
    (tmp_path / "tokens").mkdir()
    (tmp_path / "split").mkdir()
    tok, n, _ = tokens.tokenize_text(
        str(raw), TokenizerConfig(kind="word", strip_gutenberg=False), str(tmp_path / "tokens")
    )
    vocab = Vocab.build(tokens.count_tokens(str(tmp_path / "tokens")))
    cfg = SplitConfig(contiguous=False, shuffle_chunk=50, val_fraction=0.2, test_fraction=0.1)
    plan = splits.split_plan(n, cfg)
    written = {
        w.name: w for w in splits.write_splits(str(tmp_path / "tokens"), vocab, tok, plan, str(tmp_path / "split"))
    }
    all_ids = np.array(vocab.encode([t for ts in tok.tokenize(read_chunks(str(raw))) for t in ts]))
    for name in ("train", "val", "test"):
        want = np.concatenate([all_ids[a:b] for a, b, s in plan if s == name])
        got = np.load(tmp_path / "split" / f"{name}.npy")
        assert got.tolist() == want.tolist()
        assert pq.read_table(tmp_path / "split" / f"{name}.parquet").column("token_id").to_pylist() == want.tolist()
        per = splits.bytes_per_token(vocab, tok)
        assert written[name].n_tokens == len(want) and written[name].n_bytes == int(per[want].sum())


# -- source encodings ------------------------------------------------------------------------------


TEXT = "Prince Andrew said: “Moscow, 1812” — naïve ☃ 😀.\r\nNext line.\n" * 200


@pytest.mark.parametrize(
    "encoding,bom",
    [
        ("utf-16-le", codecs.BOM_UTF16_LE),
        ("utf-16-be", codecs.BOM_UTF16_BE),
        ("utf-32-le", codecs.BOM_UTF32_LE),
        ("utf-32-be", codecs.BOM_UTF32_BE),
        ("utf-8", codecs.BOM_UTF8),
        ("utf-8", b""),
    ],
)
def test_download_stores_utf8_and_pins_the_source_bytes(encoding: str, bom: bytes, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus, "BLOCK", 7)  # a BOM and characters split between reads
    src = tmp_path / "src.txt"
    data = bom + TEXT.encode(encoding)
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()  # what sha256sum prints for the file
    got = corpus.download(str(src), lambda s: str(tmp_path / f"{s}.txt"), sha256=sha)
    assert got.sha256 == sha and got.bytes == len(data)
    assert (tmp_path / f"{sha}.txt").read_bytes() == TEXT.encode("utf-8")
    assert got.encoding == {"utf-8": "utf-8-sig" if bom else "utf-8"}.get(encoding, encoding)
    assert got.converted == bool(bom)
    assert "".join(read_chunks(str(src), chunk_chars=5)) == TEXT.replace("\r\n", "\n")


@pytest.mark.parametrize(
    "case", ["utf16-no-bom-le", "utf16-no-bom-be", "latin1", "binary", "truncated-utf16", "bom-only", "folder"]
)
def test_download_refuses_what_it_cannot_read_and_writes_nothing(case: str, tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    want = {
        "utf16-no-bom-le": r"UTF-16 .*iconv -f utf-16le -t utf-8",
        "utf16-no-bom-be": r"UTF-16 .*iconv -f utf-16be -t utf-8",
        "latin1": r"not UTF-8 .*offset 6\b.*iconv -f latin1",
        "binary": "looks binary",
        "truncated-utf16": "truncated",
        "bom-only": "empty",
        "folder": "is a folder: give the text file",
    }[case]
    if case.startswith("utf16-no-bom"):
        src.write_bytes(TEXT.encode("utf-16-le" if case.endswith("le") else "utf-16-be"))
    elif case == "latin1":
        src.write_bytes("Un caf\xe9 à Moscou.\n".encode("latin-1") * 20)
    elif case == "binary":
        src.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 50)
    elif case == "truncated-utf16":
        src.write_bytes(codecs.BOM_UTF16_LE + TEXT.encode("utf-16-le")[:-1])
    elif case == "bom-only":
        src.write_bytes(codecs.BOM_UTF16_LE)
    else:
        src.mkdir()
    store = tmp_path / "store"
    with pytest.raises(UserError, match=want) as e:
        corpus.download(str(src), lambda s: str(store / f"{s}.txt"))
    assert "\n" not in str(e.value)
    assert not store.exists()


# -- several Gutenberg books in one file -----------------------------------------------------------


def book(title: str, body: str) -> str:
    return (
        f"The Project Gutenberg eBook of {title}\n\nThis eBook is for the use of anyone anywhere.\n"
        f"*** START OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n"
        + body
        + f"*** END OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n"
        "Section 1. General Terms of Use and Redistributing Project Gutenberg licence.\n" * 3
    )


def three_books() -> tuple[str, list[str]]:
    bodies = [
        f"\nCHAPTER I\n\n{word} was here. " * 50 + f"\nThe end of {word}.\n\n"
        for word in ("Natasha", "Hamlet", "Ishmael")
    ]
    return "".join(book(t, b) for t, b in zip(("War and Peace", "Hamlet", "Moby Dick"), bodies)), bodies


def test_strip_gutenberg_keeps_every_book_of_a_concatenation() -> None:
    text, bodies = three_books()
    assert "".join(strip_gutenberg([text])) == "".join(bodies)
    rng = random.Random(7)
    for n in (1, 3, 17, 400):
        assert "".join(strip_gutenberg(text[i : i + n] for i in range(0, len(text), n))) == "".join(bodies)
    assert "".join(strip_gutenberg(cut(text, rng))) == "".join(bodies)


def test_three_books_tokenized_keep_all_bodies_and_no_licence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tokens, "CHUNK_CHARS", 100)  # markers and bodies across chunk boundaries
    text, bodies = three_books()
    raw = tmp_path / "raw.txt"
    raw.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    (tmp_path / "tokens").mkdir()
    _, n, _ = tokens.tokenize_text(str(raw), TokenizerConfig(kind="word"), str(tmp_path / "tokens"))
    counts = tokens.count_tokens(str(tmp_path / "tokens"))
    for name in ("natasha", "hamlet", "ishmael"):
        assert counts[name] == 51  # 50 sentences and "The end of ..."
    assert not {"gutenberg", "licence", "ebook", "start", "redistributing"} & set(counts)
