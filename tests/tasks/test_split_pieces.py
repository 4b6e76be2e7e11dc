"""A split stored as pieces (a corpus of many files) reads exactly as the one flat array it stands
for: ids, windows, evaluation figures, CBOW batches and every DDP rank's share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mllm import UserError, storage
from mllm.config import CbowConfig, model_config
from mllm.embeddings.cbow import CbowBatches
from mllm.families.base import build_model
from mllm.lm.evaluate import evaluate, ngram_baseline
from mllm.lm.windows import EpochWindows, RandomWindows, eval_starts, windows
from mllm.runtime.epochs import CHAIN, ChainedIds, chain_digest, ids_digest, load_ids

# Pieces of uneven sizes, one of a single token, so windows and contexts cross their ends.
CUTS = [0, 1700, 1701, 4000, 4090, 6000]


def _stored(tmp_path: Path, seed: int = 0) -> tuple[np.ndarray, str]:
    """A flat array of ids, and the manifest of the same ids cut into pieces at CUTS."""
    flat = np.random.default_rng(seed).integers(0, 40, size=CUTS[-1]).astype(np.uint8)
    pieces = []
    for i, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        url = str(tmp_path / f"piece{i}" / "train.npy")
        Path(url).parent.mkdir()
        np.save(url, flat[a:b])
        pieces.append({"url": url, "tokens": b - a, "sha256": storage.sha256_file(url)})
    manifest = str(tmp_path / "train.ids.json")
    storage.write_json(
        manifest,
        {"format": CHAIN, "pieces": pieces, "tokens": len(flat), "sha256": chain_digest([p["sha256"] for p in pieces])},
    )
    return flat, manifest


def test_pieces_index_as_the_flat_array(tmp_path: Path) -> None:
    flat, manifest = _stored(tmp_path)
    chain = load_ids(manifest)
    assert isinstance(chain, ChainedIds) and len(chain) == len(flat) and chain.dtype == flat.dtype
    assert np.array_equal(np.asarray(chain), flat) and chain.max() == flat.max() == np.max(chain)
    for s in (slice(1690, 1710), slice(1700, 1701), slice(0, None), slice(-5, None), slice(10, 10), slice(1, 5000, 97)):
        assert np.array_equal(chain[s], flat[s])
    rng = np.random.default_rng(1)
    for shape in ((300,), (40, 65), (3, 4, 5)):
        index = rng.integers(-len(flat), len(flat), size=shape)
        assert np.array_equal(chain[index], flat[index])
    assert chain[1700] == flat[1700] and chain[-1] == flat[-1]
    with pytest.raises(IndexError):
        chain[np.array([len(flat)])]


def test_windows_evaluation_and_every_rank_read_the_same_from_pieces(tmp_path: Path) -> None:
    flat, manifest = _stored(tmp_path)
    chain = load_ids(manifest)
    # Windows that start just before each piece's end.
    starts = np.array(CUTS[1:-1]) - 10
    for got, want in zip(windows(chain, starts, 32), windows(flat, starts, 32)):
        assert torch.equal(got, want)
    for rank in (0, 1):
        a, b = (RandomWindows(ids, 32, 16, seed=3, rank=rank, world_size=2) for ids in (chain, flat))
        c, d = (EpochWindows(ids, 32, 16, 5, seed=3, rank=rank, world_size=2) for ids in (chain, flat))
        for _ in range(20):
            assert all(torch.equal(x, y) for x, y in zip(a.next(), b.next()))
            assert all(torch.equal(x, y) for x, y in zip(c.next(), d.next()))
    assert np.array_equal(eval_starts(chain, 32, 50, 0), eval_starts(flat, 32, 50, 0))
    torch.manual_seed(0)
    model = build_model(model_config(arch="lstm", vocab_size=40, n_embd=8, hidden_size=16, n_layer=1)).eval()
    assert evaluate(model, chain, window=32, batch_size=8, n_bytes=7000) == evaluate(
        model, flat, window=32, batch_size=8, n_bytes=7000
    )
    assert ngram_baseline(chain, chain[:900], 40, order=2) == ngram_baseline(flat, flat[:900], 40, order=2)


def test_cbow_batches_from_pieces_are_those_of_the_flat_array(tmp_path: Path) -> None:
    flat, manifest = _stored(tmp_path)
    chain = load_ids(manifest)
    offsets = np.array([0, 500, 1695, 1702, 3000, 4093, 6000])  # paragraphs across the pieces' ends
    cfg = CbowConfig(vocab_size=40, objective="negative", n_negative=3, context=3)
    a, b = (
        CbowBatches.from_config(cfg, ids, offsets, batch_size=64, seed=7, rank=1, world_size=2) for ids in (chain, flat)
    )
    assert np.array_equal(a.centres, b.centres)
    for _ in range(30):
        assert all(torch.equal(x, y) for x, y in zip(a.next(), b.next()))


def test_a_changed_or_broken_piece_is_named(tmp_path: Path) -> None:
    flat, manifest = _stored(tmp_path)
    recorded = storage.read_json(manifest)["sha256"]
    assert ids_digest(manifest) == recorded
    piece = tmp_path / "piece2" / "train.npy"
    data = bytearray(piece.read_bytes())
    data[-1] ^= 1
    piece.write_bytes(bytes(data))
    assert ids_digest(manifest) != recorded
    # A piece cut short: one line that says which and what to do.
    np.save(piece, flat[1701:1800])
    with pytest.raises(UserError, match=r"piece2/train.npy holds 99 tokens, the split's manifest .* says 2299: re-run"):
        load_ids(manifest)
    piece.unlink()
    with pytest.raises(UserError, match=r"a piece of the split .*train.ids.json not found at .*piece2/train.npy"):
        load_ids(manifest)
    Path(manifest).write_text('{"format": "something else", "pieces": []}')
    with pytest.raises(UserError, match=r"is not a manifest of a split's pieces .*re-run the split stage"):
        load_ids(manifest)


@pytest.mark.integration  # runs Prefect tasks on the session's server
def test_cbow_trains_and_evaluates_on_a_folder_whose_splits_are_pieces(tmp_path: Path) -> None:
    from test_embeddings_pipeline import FAST, _paragraphs

    from flows.pipeline import pipeline

    folder = tmp_path / "paragraphs"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.txt").write_text(_paragraphs(2500, seed=10 + i))
    r = pipeline(
        recipe="cbow-smoke",
        source=str(folder),
        storage_url=str(tmp_path / "storage"),
        overrides=FAST + ["data.split.span_bytes=2048"],
    )
    val = load_ids(r.data.splits.val.ids)
    assert isinstance(val, ChainedIds) and len(val.pieces) >= 1 and len(val) == r.data.splits.val.n_tokens
    offsets = np.load(r.data.splits.val.offsets)
    assert offsets[0] == 0 and offsets[-1] == len(val) and len(offsets) > 2
    assert r.evaluation.headline == "wordsim353_spearman" and np.isfinite(r.evaluation.score)
    assert r.decision == "promoted"
