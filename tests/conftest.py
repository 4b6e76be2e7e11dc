"""Test isolation: Prefect, MLflow and every cache write under a temporary folder, never ~.

These variables are set before any test module imports prefect or mlflow, which read them once.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import pytest

from flows import QUIET_ENV

_HOME = Path(tempfile.mkdtemp(prefix="mllm-tests-"))
os.environ.update({
    **QUIET_ENV,
    "PREFECT_HOME": str(_HOME / "prefect"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_TRACKING_URI": f"sqlite:///{_HOME / 'mlflow.db'}",
    "XDG_CONFIG_HOME": str(_HOME / "config"),
    "XDG_CACHE_HOME": str(_HOME / "cache"),
    "MPLCONFIGDIR": str(_HOME / "matplotlib"),
    "MPLBACKEND": "Agg",
    "HF_HOME": str(_HOME / "hf"),
    "TORCHINDUCTOR_CACHE_DIR": str(_HOME / "inductor"),
    # Tiny test models run 30x slower when two threads contend for two busy cores.
    "OMP_NUM_THREADS": "1",
})
# No server named: Prefect's temporary one (a test that needs a server starts its own).
for _name in ("MLLM_STORAGE", "PREFECT_API_URL"):
    os.environ.pop(_name, None)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

WORDS = ("the a of and to in was he she it his her that with had for not on at as but they said "
         "prince princess count natasha pierre andrew moscow war peace army emperor house night "
         "day old young little great love life time man woman soldier french russian room door").split()


def make_text(n_words: int = 4000, seed: int = 0, gutenberg: bool = True) -> str:
    """A small English-like text with Gutenberg-style header and footer, made up on the spot."""
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < n_words:
        k = rng.randint(4, 14)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?", ";"]))
        words += k
    paras = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
    body = "\r\n\r\n".join(paras) + "\r\n"
    if not gutenberg:
        return body
    return ("The Project Gutenberg eBook of a Test\r\n\r\n*** START OF THE PROJECT GUTENBERG EBOOK TEST ***\r\n"
            + body + "*** END OF THE PROJECT GUTENBERG EBOOK TEST ***\r\nLicense text that must not be read.\r\n")


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


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(make_text().encode("utf-8"))
    return path


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (a subprocess on a free loopback port, temporary SQLite database)
    for the flows this test process runs; stopped after the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):
        yield


@pytest.fixture(autouse=True)
def _own_mlflow_store(tmp_path: Path, monkeypatch) -> None:
    """Each test its own MLflow store (created on first use): a champion registered by one
    test must not make another skip its training."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow-store' / 'mlflow.db'}")
    (tmp_path / "mlflow-store").mkdir()
