"""A prompt's characters that the model's normalisation drops (accents, ':'), named on the terminal
by `mllm-pipeline sample` and `python -m mllm.sample`, which then sample from what is left. (The
served model refuses such a prompt: tests/tasks/test_tracking.py.)"""

from __future__ import annotations

import prewarmed
import pytest
import torch
from commands import cli

from mllm.data.text import build_tokenizer
from mllm.data.vocab import UNK, Vocab
from mllm.families.base import build_model
from mllm.resolve import resolve
from mllm.runtime.checkpoint import load_checkpoint, save_checkpoint
from mllm.sample import answer

pytestmark = pytest.mark.integration

WARNING = (
    "warning: the prompt 'Thé: ' loses 'é' ':' to the normalisation its model's corpus had (the model reads 'Th ')"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """An untrained smoke (char LSTM, normalising) checkpoint: what it answers is not the point."""
    cfg = resolve("smoke")
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    vocab = Vocab([UNK, *dict.fromkeys(tokenizer.split("The war and the peace"))])
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": len(vocab)})})
    torch.manual_seed(0)
    url = str(tmp_path_factory.mktemp("ckpt") / "smoke.pt")
    save_checkpoint(
        url,
        {
            "model": build_model(cfg.model).state_dict(),
            "step": 0,
            "config": cfg.to_dict(),
            "vocab": vocab.to_json(),
            "vocab_digest": vocab.digest,
            "tokenizer": tokenizer.to_json(),
        },
    )
    return url


def test_python_m_mllm_sample_names_what_the_prompt_loses(checkpoint: str) -> None:
    out = prewarmed.run(
        "mllm.sample", ["--checkpoint", checkpoint, "--prompt", "Thé: ", "--method", "greedy"], timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [WARNING]
    expected = answer(load_checkpoint(checkpoint), ["Th "], method="greedy")
    assert out.stdout.strip() == "\n".join(expected).strip() and out.stdout.startswith("Th ")
    quiet = prewarmed.run("mllm.sample", ["--checkpoint", checkpoint, "--prompt", "The "], timeout=120)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_the_cli_sample_names_what_the_prompt_loses(checkpoint: str) -> None:
    out = cli("sample", "--checkpoint", checkpoint, "--prompt", "Thé: ", "--method", "greedy")
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stderr.splitlines() if line.strip()] == [WARNING]
    assert out.stdout.startswith("Th ")
