"""What the dropped-characters warning counts (issue 64, item 13): only what normalisation really
loses, by kind, the kinds adding up to the total."""

from __future__ import annotations

from mllm.data.text import CharTokenizer
from tasks.data import Tokens
from tasks.data.tokenize import WHITESPACE, dropped_line, lost_by_kind


def tokens_of(chunks: list[str]) -> tuple[Tokens, str]:
    tok = CharTokenizer(normalize=True)
    out = "".join(t for piece in tok.tokenize(chunks) for t in piece)
    chars, lost = tok.take_loss()
    return Tokens(
        key="k", url="u", tokenizer="t", n_tokens=len(out), n_chunks=1, raw_sha256="r", chars=chars, lost=lost
    ), out


def test_a_newline_turned_into_a_space_is_not_dropped_and_the_kinds_add_up_to_the_total():
    # Lines of prose whose single newlines become spaces (nothing lost), one paragraph break (two
    # newlines become one space: one lost), a double space (one lost), a colon, two accents.
    text = "It was the best\nof times, it was\nthe worst of times.\n\nCaf\u00e9  na\u00efve: yes\n"
    tokens, out = tokens_of([text])
    assert out == "It was the best of times, it was the worst of times. Caf nave yes "
    assert lost_by_kind(tokens) == {WHITESPACE: 2, ":": 1, "non-ASCII": 2}
    assert sum(lost_by_kind(tokens).values()) == tokens.chars - tokens.n_tokens == len(text) - len(out)


def test_the_warning_of_prose_with_short_lines_names_what_is_lost_not_its_newlines():
    # War and Peace's shape: short lines, single newlines between words, paragraphs, accents.
    line = "Prince Andrew looked at the sky\nand said nothing; he was tired.\n"
    text = (line * 3 + "\n") * 30 + "\u00c9l\u00e8ve fran\u00e7ais \u00e0 Moscou.\n" * 40
    tokens, out = tokens_of([text[:1000], text[1000:]])  # a chunk boundary inside a run too
    kinds = lost_by_kind(tokens)
    share = (tokens.chars - tokens.n_tokens) / tokens.chars
    assert sum(kinds.values()) == tokens.chars - tokens.n_tokens
    # One a paragraph break, one a line where the dropped 'à' left two spaces; a line's newline is a space.
    assert kinds[WHITESPACE] == 30 + 40
    line = dropped_line(tokens)
    assert line.startswith(
        f"the tokenizer's normalisation dropped {share:.1%} of the corpus's characters (most: "
        f"non-ASCII {kinds['non-ASCII'] / tokens.chars:.1%}, "
    )
    assert "'\\n'" not in line and WHITESPACE in line
