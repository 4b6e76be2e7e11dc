"""Made-up text for tests: an English-like corpus and its character ids.

Plain functions, no pytest: the tests import them from here (tests/mllm/test_gpu.py too, which runs
with --noconftest on a GPU machine that has no Prefect or MLflow); and where ../shared/data is.
"""

from __future__ import annotations

import random
from pathlib import Path

# War and Peace and tiny shakespeare, beside the checkout (tests that read them skip without them).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

WORDS = (
    "the a of and to in was he she it his her that with had for not on at as but they said "
    "prince princess count natasha pierre andrew moscow war peace army emperor house night "
    "day old young little great love life time man woman soldier french russian room door"
).split()


def make_text(n_words: int = 4000, seed: int = 0, gutenberg: bool = True) -> str:
    """A small English-like text with Gutenberg-style header and footer, made up on the spot."""
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < n_words:
        k = rng.randint(4, 14)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?", ";"]))
        words += k
    paras = [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]
    body = "\r\n\r\n".join(paras) + "\r\n"
    if not gutenberg:
        return body
    return (
        "The Project Gutenberg eBook of a Test\r\n\r\n*** START OF THE PROJECT GUTENBERG EBOOK TEST ***\r\n"
        + body
        + "*** END OF THE PROJECT GUTENBERG EBOOK TEST ***\r\nLicense text that must not be read.\r\n"
    )


def write_char_ids(folder: Path, n_words: int):
    """Character ids of a made-up text in `folder`: train.npy and val.npy (90/10) and vocab.json."""
    from collections import Counter

    import numpy as np

    from mllm.config import TokenizerConfig
    from mllm.data.text import build_tokenizer
    from mllm.data.vocab import Vocab

    tokenizer = build_tokenizer(TokenizerConfig(kind="char"))
    tokens = [t for piece in tokenizer.tokenize([make_text(n_words, gutenberg=False)]) for t in piece]
    vocab = Vocab.build(Counter(tokens))
    ids = np.asarray(vocab.encode(tokens), dtype=np.uint16)
    cut = int(0.9 * len(ids))
    np.save(folder / "train.npy", ids[:cut])
    np.save(folder / "val.npy", ids[cut:])
    vocab.save(str(folder / "vocab.json"))
    return vocab
