"""Exports (mllm.export): a GPT as a transformers folder that generates the same tokens and logits
as mllm, every family in onnxruntime with the same logits, a GPT's GGUF tensors equal to the
checkpoint's, and a piece no format can hold refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import prewarmed
import pytest
import torch

pytest.importorskip("transformers")
onnxruntime = pytest.importorskip("onnxruntime")
gguf = pytest.importorskip("gguf")

from textdata import make_text, write_char_ids  # noqa: E402 (imported once the optional libraries above are found)

from mllm.config import RunConfig  # noqa: E402 (imported once the optional libraries above are found)
from mllm.data.text import BpeTokenizer, build_tokenizer  # noqa: E402 (imported once the optional libraries above are found)
from mllm.data.vocab import UNK, Vocab  # noqa: E402 (imported once the optional libraries above are found)
from mllm.export import VOCAB, export  # noqa: E402 (imported once the optional libraries above are found)
from mllm.export import gguf as export_gguf  # noqa: E402 (imported once the optional libraries above are found)
from mllm.export.tokenizer import fast_tokenizer  # noqa: E402 (imported once the optional libraries above are found)
from mllm.families.base import build_model, family_of  # noqa: E402 (imported once the optional libraries above are found)
from mllm.lm.generate import generate  # noqa: E402 (imported once the optional libraries above are found)
from mllm.resolve import resolve  # noqa: E402 (imported once the optional libraries above are found)
from mllm.runtime.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402 (imported once the optional libraries above are found)
from mllm.train import train  # noqa: E402 (imported once the optional libraries above are found)

WAR_AND_PEACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "warandpeace.txt"
BLOCK = 256
# nanoGPT's pieces, and the default recipe's (rotary, ReLU², no bias; tied head in both).
PIECES = {"nanogpt": {"bias": True}, "default": {"bias": False, "positions": "rotary", "mlp": "relu2"}}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    write_char_ids(d, 3000)
    return d


@pytest.fixture(scope="module", params=sorted(PIECES))
def trained(request, data_dir, tmp_path_factory) -> str:
    """A smoke GPT with one piece set, trained here for a few dozen steps: its best checkpoint."""
    model = {
        "arch": "gpt",
        "n_embd": 32,
        "n_head": 2,
        "n_layer": 2,
        "block_size": BLOCK,
        "dropout": 0.0,
        **PIECES[request.param],
    }
    cfg = RunConfig.model_validate(
        {
            "model": model,
            "train": {
                "batch_size": 8,
                "window": 64,
                "max_steps": 40,
                "log_interval": 20,
                "eval_interval": 20,
                "eval_batches": 2,
                "checkpoint_interval": 20,
                "optimizer": "adamw",
                "lr": 1e-2,
            },
            "paths": {
                "train_ids": str(data_dir / "train.npy"),
                "val_ids": str(data_dir / "val.npy"),
                "vocab": str(data_dir / "vocab.json"),
                "checkpoint_dir": str(tmp_path_factory.mktemp(request.param)),
            },
        }
    )
    return train(cfg).best_checkpoint


def _window(data_dir: Path) -> torch.Tensor:
    ids = np.load(data_dir / "val.npy")[:BLOCK].astype(np.int64)
    assert len(ids) == BLOCK
    return torch.from_numpy(ids)[None]


def _hf_equals_mllm(loaded, window: torch.Tensor, out: Path) -> list[int]:
    """Export to `out`; the logits of `window` and 200 greedy tokens after "The " agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = export(loaded, "hf", str(out), {"corpus_sha256": "ab" * 32, "mlflow_run": "run123"})
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md", VOCAB} <= set(
        done["files"]
    ) and done["libraries"]["transformers"]
    card = (out / "README.md").read_text()
    assert "ab" * 32 in card and "run123" in card
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rotary = loaded.model.config.positions == "rotary"
    assert hf.config.model_type == ("gpt_neox" if rotary else "gpt2")
    with torch.no_grad():
        ours, theirs = loaded.model(window)[0], hf(window).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The ")["input_ids"]
    assert prompt == loaded.vocab.encode(loaded.tokenizer.split("The "))
    # 200 tokens whatever they are (no stop at <eos>), then as `sample` runs: stopping at <eos>.
    mine = generate(loaded.model, prompt, 200, method="greedy", dtype="float32")
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False, eos_token_id=None)
    assert got[0, len(prompt) :].tolist() == mine
    # The same text, as mllm's sample_text writes it and transformers' tokenizer decodes it.
    assert tokenizer.decode(got[0]) == loaded.tokenizer.detokenize(loaded.vocab.decode(prompt + mine))
    eos = loaded.vocab.stoi.get("<eos>")
    if eos is not None:
        stopped = generate(loaded.model, prompt, 200, method="greedy", dtype="float32", eos_id=eos)
        with torch.no_grad():
            got = hf.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False)[0, len(prompt) :].tolist()
        assert (got[:-1] if got and got[-1] == eos else got) == stopped
    return mine


def test_hf_of_a_trained_smoke_gpt_generates_its_greedy_tokens(trained, data_dir, tmp_path):
    loaded = load_checkpoint(trained)
    _hf_equals_mllm(loaded, _window(data_dir), tmp_path / "hf")
    assert "val_loss" in (tmp_path / "hf" / "README.md").read_text()  # the run's metrics are on the card


@pytest.mark.parametrize("pieces", sorted(PIECES))
def test_hf_of_confident_random_weights_generates_the_same_varied_text(pieces, tmp_path):
    # Weights at std 0.2: confident predictions, so the 200 tokens vary and no near-tie hides a difference.
    loaded = load_checkpoint(_checkpoint("default", tmp_path, std=0.2, **PIECES[pieces]))
    window = torch.randint(0, len(loaded.vocab), (1, BLOCK), generator=torch.Generator().manual_seed(0))
    mine = _hf_equals_mllm(loaded, window, tmp_path / "hf")
    assert len(set(mine)) > 5


@pytest.mark.slow
def test_an_exported_folder_loads_with_transformers_alone(trained, tmp_path):
    """In an interpreter that has no site processing (so no editable install of mllm, whose
    finder a .pth file registers) and only site-packages on its path: transformers and torch
    import, mllm does not. A fresh venv would say the same after minutes of installing torch."""
    loaded = load_checkpoint(trained)
    out = tmp_path / "hf"
    export(loaded, "hf", str(out))
    text = WAR_AND_PEACE.read_text(encoding="utf-8")[:10_000] if WAR_AND_PEACE.exists() else make_text(2000)
    script = f"""
import importlib.util, json, sys
sys.path.append({sysconfig.get_paths()["purelib"]!r})
assert importlib.util.find_spec("mllm") is None, "mllm is importable"
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(out)!r})
model = AutoModelForCausalLM.from_pretrained({str(out)!r})
text = sys.stdin.read()
ids = tok(text)["input_ids"]
print(json.dumps({{"ids": ids, "text": tok.decode(ids), "arch": type(model).__name__}}))
"""
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        input=text,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    tokens = loaded.tokenizer.split(text)
    assert got["ids"] == loaded.vocab.encode(tokens)
    assert got["text"] == loaded.tokenizer.detokenize(loaded.vocab.decode(got["ids"]))
    if not WAR_AND_PEACE.exists():
        pytest.skip("../shared/data/warandpeace.txt is absent: checked on made-up text instead")


def test_the_model_card_and_manifest_hold_no_password(tmp_path):
    secret = "s3cr3t-Passw0rd-card"
    url = _checkpoint("default", tmp_path, source=f"https://reader:{secret}@127.0.0.1:1/corpus.txt")
    export(load_checkpoint(url), "hf", str(tmp_path / "hf"), {"corpus_source": f"https://reader:{secret}@host/c.txt"})
    for f in (tmp_path / "hf").iterdir():
        assert secret not in f.read_text(errors="replace"), f.name
    assert "127.0.0.1:1/corpus.txt" in (tmp_path / "hf" / "README.md").read_text()


def _tokenizers() -> list:
    text = make_text(3000, gutenberg=False) + " Ünïcode — “quotes” <br /> tabs\tand\nlines"
    out = []
    for kind, normalize in (("char", True), ("char", False), ("word", True), ("word", False)):
        out.append(
            build_tokenizer(
                RunConfig.model_validate({}).data.tokenizer.model_copy(update={"kind": kind, "normalize": normalize})
            )
        )
    out.append(BpeTokenizer.train([text], 300))
    return out


@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: f"{t.kind}-{t.normalize}")
def test_the_hf_tokenizer_encodes_and_decodes_as_mllms(tok):
    text = WAR_AND_PEACE.read_text(encoding="utf-8")[:10_000] if WAR_AND_PEACE.exists() else make_text(2000)
    tokens = tok.split(text)
    # A vocabulary from the text's first half: the second half has tokens it lacks (<unk>).
    vocab = Vocab.build(Counter(tokens[: len(tokens) // 2] if tok.kind != "bpe" else tok._itos), specials=["<eos>"])
    if tok.kind == "bpe":
        vocab = Vocab([UNK, "<eos>", *[t for t in tok._itos if t not in (UNK, "<eos>")]])
    hf = fast_tokenizer(tok, vocab)
    ids = hf(text)["input_ids"]
    assert ids == vocab.encode(tokens)
    assert hf.decode(ids) == tok.detokenize(vocab.decode(ids))
    if tok.kind != "bpe":
        assert 0 in ids  # the unknown tokens were met, and became <unk> on both sides


def _checkpoint(recipe: str, folder: Path, std: float | None = None, source: str | None = None, **model) -> str:
    """An untrained checkpoint of a shipped recipe's model, its weights shaken so that every layer
    matters (or its matrices drawn at `std`), with the vocabularies it needs."""
    cfg = resolve(recipe)
    if source is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": source})})
    tokenizer, extra = build_tokenizer(cfg.data.tokenizer), {}
    words = "the war and the peace said the prince to the princess".split()
    vocab = Vocab([UNK, "<pad>", "<bos>", "<eos>", *dict.fromkeys(words + list("abcdefghijklmnopqrstuvwxyz "))])
    sizes = {
        f: len(vocab) for f in ("vocab_size", "src_vocab_size", "tgt_vocab_size") if f in type(cfg.model).model_fields
    }
    if family_of(cfg).data == "pairs":
        extra = {"src_vocab": vocab.to_json(), "src_tokenizer": tokenizer.to_json()}
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={**sizes, **model, "dropout": 0.0})})
    torch.manual_seed(0)
    net = build_model(cfg.model)
    with torch.no_grad():
        for p in net.parameters():
            if std is None:
                p.add_(torch.randn_like(p) * 0.05)
            elif p.dim() == 2:
                p.normal_(0, std)
    url = str(folder / f"{recipe}.pt")
    save_checkpoint(
        url,
        {
            "model": net.state_dict(),
            "step": 0,
            "config": cfg.to_dict(),
            "vocab": vocab.to_json(),
            "vocab_digest": vocab.digest,
            "tokenizer": tokenizer.to_json(),
            **extra,
        },
    )
    return url


ONNX_CASES = {
    "gpt-every-piece": (
        "default",
        {"qk_norm": True, "value_embeds": True, "residual_scalars": True, "logit_softcap": 15.0, "norm": "rmsnorm"},
    ),
    "gpt-nanogpt": ("default", {"positions": "learned", "mlp": "gelu", "bias": True}),
    "gpt-sinusoidal": ("default", {"positions": "sinusoidal"}),
    "lstm": ("smoke", {}),
    "gru": ("smoke", {"arch": "gru"}),
    "lstm-from-scratch": ("smoke", {"from_scratch": True}),
    "rnn-from-scratch": ("smoke", {"arch": "rnn", "from_scratch": True}),
    "sequences": ("sequences-smoke", {}),
    "cbow": ("cbow-smoke", {}),
    "seq2seq-rnn": ("seq2seq-numbers-rnn", {}),
    "seq2seq-transformer": ("seq2seq-numbers-transformer", {}),
}


def _session(folder: Path, name: str = "model.onnx"):
    return onnxruntime.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])


def _gpt_pairs(model, s) -> list:
    """A prompt of 30 tokens, then 10 more fed with the cache the first call returned."""
    x = torch.randint(1, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    c = model.config
    empty = np.zeros((c.n_layer, 2, c.n_head, 0, c.n_embd // c.n_head), np.float32)
    first, keys, values = s.run(None, {"input_ids": x[:, :30].numpy(), "past_keys": empty, "past_values": empty})
    second, _, _ = s.run(None, {"input_ids": x[:, 30:].numpy(), "past_keys": keys, "past_values": values})
    return [(model(x)[0], np.concatenate([first, second], axis=1))]


def _recurrent_pairs(model, s) -> list:
    x = torch.randint(1, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    logits, _, state = model(x)
    state = state if isinstance(state, tuple) else (state,)
    names = [i.name for i in s.get_inputs()][1:]
    carried = {n: np.zeros(tuple(state[0].shape), np.float32) for n in names}
    got = []
    for part in (x[:, :12], x[:, 12:]):  # the state carried from one call to the next
        outs = s.run(None, {"input_ids": part.numpy(), **carried})
        got.append(outs[0])
        carried = dict(zip(names, outs[1:]))
    return [(logits, np.concatenate(got, axis=1)), *zip(state, carried.values())]


def _cbow_pairs(model, s) -> list:
    ctx = torch.randint(1, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    h = model.encode(ctx, mask)
    vector, scores = s.run(None, {"context": ctx.numpy(), "mask": mask.numpy()})
    return [(h, vector), (model.head(h), scores)]


def _seq2seq_pairs(model, folder: Path) -> list:
    enc, dec = _session(folder, "encoder.onnx"), _session(folder, "decoder_step.onnx")
    src = torch.tensor([[4, 7, 9, 11, 5], [6, 8, 1, 1, 1]])  # the second padded (<pad> is 1)
    memory, state, token = model.encode(src), None, torch.tensor([2, 2])
    state = model.start(memory)
    feeds = dict(zip([o.name for o in enc.get_outputs()], enc.run(None, {"src": src.numpy()})))
    c = model.config
    past = np.zeros((c.n_layer, 2, c.n_head, 0, c.n_embd // c.n_head), np.float32)
    carried = {"state": feeds.get("init"), "past_keys": past, "past_values": past}
    pairs = []
    for _ in range(4):
        logits, state, _ = model.step(memory, state, token)
        names = [i.name for i in dec.get_inputs()]
        outs = dec.run(None, {n: ({"token": token.numpy(), **feeds, **carried})[n] for n in names})
        carried = {"state": outs[1], "past_keys": outs[1], "past_values": outs[-1]}
        pairs.append((logits, outs[0]))
        token = logits.argmax(-1)
    return pairs


@pytest.mark.parametrize("case", sorted(ONNX_CASES))
def test_onnxruntime_gives_the_models_logits(case, tmp_path):
    recipe, overrides = ONNX_CASES[case]
    loaded = load_checkpoint(_checkpoint(recipe, tmp_path, **overrides))
    out = tmp_path / "onnx"
    done = export(loaded, "onnx", str(out))
    model = loaded.model
    with torch.no_grad():
        if "encoder.onnx" in done["files"]:
            pairs = _seq2seq_pairs(model, out)
        else:
            s = _session(out)
            inputs = [i.name for i in s.get_inputs()]
            kind = _gpt_pairs if "past_keys" in inputs else _cbow_pairs if "context" in inputs else _recurrent_pairs
            pairs = kind(model, s)
    for ours, theirs in pairs:
        assert ours.shape == theirs.shape
        assert np.abs(ours.numpy() - theirs).max() < 1e-4


@pytest.mark.parametrize(
    "pieces,arch",
    [({}, "nemotron"), ({"mlp": "gelu"}, "gptneox"), ({"positions": "learned", "mlp": "gelu", "bias": True}, "gpt2")],
)
def test_gguf_holds_the_checkpoints_tensors(pieces, arch, tmp_path):
    loaded = load_checkpoint(_checkpoint("default", tmp_path, **pieces))
    export(loaded, "gguf", str(tmp_path / "gguf"))
    reader = gguf.GGUFReader(str(tmp_path / "gguf" / "model.gguf"))
    field = lambda name: reader.fields[name].contents()  # noqa: E731 (a one-line helper, named where it is used)
    c, sd = loaded.model.config, loaded.model.state_dict()
    assert field("general.architecture") == arch
    assert field(f"{arch}.block_count") == c.n_layer and field(f"{arch}.context_length") == c.block_size
    assert field(f"{arch}.embedding_length") == c.n_embd and field(f"{arch}.attention.head_count") == c.n_head
    assert len(field("tokenizer.ggml.tokens")) == len(loaded.vocab) == c.vocab_size
    tensors = {t.name: np.asarray(t.data).reshape(list(reversed([int(d) for d in t.shape]))) for t in reader.tensors}
    assert set(tensors) == set(export_gguf.tensors(loaded.model))
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    # Named pieces against the checkpoint itself, then every tensor against the mapping.
    assert np.array_equal(tensors["token_embd.weight"], sd["transformer.wte.weight"].numpy())
    assert np.array_equal(tensors["blk.1.ffn_up.weight"], sd["transformer.h.1.mlp.c_fc.weight"].numpy())
    qkv = sd["transformer.h.0.attn.c_attn.weight"].numpy()
    if arch == "nemotron":
        assert np.array_equal(tensors["blk.0.attn_k.weight"], qkv[c.n_embd : 2 * c.n_embd])
    else:
        assert np.array_equal(tensors["blk.0.attn_qkv.weight"], qkv)
    for name, t in export_gguf.tensors(loaded.model).items():
        assert np.array_equal(tensors[name], t.numpy()), name


@pytest.mark.parametrize(
    "recipe,pieces,fmt,named",
    [
        ("default", {"qk_norm": True}, "hf", "qk_norm"),
        ("default", {"norm": "rmsnorm"}, "gguf", "norm: rmsnorm"),
        ("default", {"value_embeds": True}, "gguf", "value_embeds"),
        ("default", {"positions": "learned", "logit_softcap": 15.0}, "hf", "logit_softcap"),
        ("smoke", {}, "hf", "lstm"),
    ],
)
def test_a_piece_no_format_holds_is_refused_in_one_line_and_nothing_is_written(recipe, pieces, fmt, named, tmp_path):
    url = _checkpoint(recipe, tmp_path, **pieces)
    out, before = tmp_path / "out", sorted(tmp_path.iterdir())
    run = prewarmed.run("mllm.export", ["--checkpoint", url, "--format", fmt, "--out", str(out)], timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0] and "onnx" in lines[0], lines
    assert not out.exists() and sorted(tmp_path.iterdir()) == before


def test_python_m_mllm_export_writes_a_folder(tmp_path):
    url = _checkpoint("smoke", tmp_path)
    out = tmp_path / "onnx"
    run = prewarmed.run("mllm.export", ["--checkpoint", url, "--format", "onnx", "--out", str(out)], timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"exported {url} as onnx to {out}")
    manifest = json.loads((out / "mllm-export.json").read_text())
    assert manifest["format"] == "onnx" and set(manifest["libraries"]) == {"torch", "onnx", "onnxruntime"}
    assert {"model.onnx", VOCAB} <= set(manifest["files"]) and all((out / f).is_file() for f in manifest["files"])
    assert Vocab.from_json((out / VOCAB).read_text()) == load_checkpoint(url).vocab
