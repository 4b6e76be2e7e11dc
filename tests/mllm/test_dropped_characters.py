"""What the normalising char tokenizer reports as dropped (issue 64, item 13): only what is really
lost, by kind, the kinds adding up to the total."""

from __future__ import annotations

from mllm.data.text import WHITESPACE, CharTokenizer


def test_a_single_newline_turned_into_a_space_is_not_dropped_and_the_kinds_add_up():
    # Lines of prose (single newlines become spaces: nothing lost), one paragraph break (two
    # newlines become one space: one lost), a double space (one lost), a colon, two accents.
    text = "It was the best\nof times, it was\nthe worst of times.\n\nCaf\u00e9  na\u00efve: yes\n"
    tok = CharTokenizer(normalize=True)
    out = "".join(t for piece in tok.tokenize([text]) for t in piece)
    assert out == "It was the best of times, it was the worst of times. Caf nave yes "
    read, lost = tok.take_loss()
    assert read == len(text)
    assert lost == {WHITESPACE: 2, ":": 1, "non-ASCII": 2}
    assert sum(lost.values()) == read - len(out)


def test_the_loss_is_counted_the_same_across_chunk_boundaries():
    tok = CharTokenizer(normalize=True)
    chunks = ["one\n", "\ntwo \n", " three\n"]
    out = "".join(t for piece in tok.tokenize(chunks) for t in piece)
    read, lost = tok.take_loss()
    assert out == "one two three "
    assert lost == {WHITESPACE: read - len(out)} == {WHITESPACE: 3}
    assert tok.take_loss() == (0, {})  # counters reset
