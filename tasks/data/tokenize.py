"""The tokenize stage: one text file to Parquet token chunks; a corpus file by file into packs,
each file's tokens made once per tokenizer and reused by every corpus that holds it (a BPE
tokenizer trained first on a sample of the corpus)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from mllm import UserError, layout, storage
from mllm.config import DataConfig, TokenizerConfig
from mllm.data import corpus, files, gutenberg, packs, text
from mllm.data import tokens as token_chunks
from tasks import assets, report_progress
from tasks.caching import forget_exception, retry_unless_mistake, stage_cache
from tasks.data import RawText, Tokens, finished, write_manifest
from tasks.data.download import FileRecord, manifest_files
from tasks.data.fan_out import PACK_BYTES, fan_out


def _tokens_key(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    return storage.digest(
        ["tokens", raw.sha256, cfg.model_dump(), layout.code_digest(corpus, gutenberg, text, token_chunks)]
    )


@task(
    name="tokenize",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_tokens_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def tokenize(raw: RawText, cfg: TokenizerConfig, root: str) -> Tokens:
    """Stream the raw text through the tokenizer into a Parquet dataset of token chunks."""
    key = _tokens_key(raw, cfg, root)
    url = layout.folder(root, layout.TOKENS, key)
    assets.materializes(url, reads=[raw.url], name="token chunks")
    if done := finished(url, Tokens):
        return done
    with storage.staged_dir(url) as out:
        tokenizer, n_tokens, n_chunks = token_chunks.tokenize_text(
            raw.url, cfg, out, source=raw.source, progress=lambda n: report_progress("tokenize", n, None)
        )
        report_progress("tokenize", n_tokens, n_tokens)
        storage.write_text(storage.join(out, "tokenizer.json"), tokenizer.to_json())
        chars, lost = tokenizer.take_loss() or (None, None)
        result = Tokens(
            key=key,
            url=url,
            tokenizer=storage.join(url, "tokenizer.json"),
            n_tokens=n_tokens,
            n_chunks=n_chunks,
            raw_sha256=raw.sha256,
            chars=chars,
            lost=lost,
        )
        write_manifest(out, result)
    assets.describe(url, key=key, tokenizer=cfg.kind, n_tokens=n_tokens, n_chunks=n_chunks, raw_sha256=raw.sha256)
    get_run_logger().info("tokenized %s: %d tokens in %d chunks", raw.source, n_tokens, n_chunks)
    return result


class PackSpec(BaseModel):
    key: str
    url: str
    files: list[tuple[str, str]]  # (sha256, stored url) of each file in the pack


def _sample(records: list[FileRecord], cap: int) -> list[tuple[FileRecord, int]]:
    """The BPE training sample: whole files in digest order up to `cap` bytes, the last one cut."""
    out, left = [], cap
    for r in sorted(records, key=lambda r: r.key):
        if left <= 0:
            break
        out.append((r, min(r.bytes, left)))
        left -= r.bytes
    return out


def _sample_key(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    sample = [(r.key, n) for r, n in _sample(manifest_files(raw), cfg.train_bytes)]
    return storage.digest(
        ["bpe", sample, cfg.model_dump(exclude={"train_bytes"}), layout.code_digest(files, text, gutenberg)]
    )


def _sample_chunks(sample: list[tuple[FileRecord, int]], strip: bool):
    for r, n in sample:
        for doc in files.documents(r.url, strip, 1 << 16):
            for chunk in doc:
                if n <= 0:
                    break
                yield chunk[:n]
                n -= len(chunk)
            if n <= 0:
                break


@task(
    name="train-tokenizer",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_sample_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def train_tokenizer(raw: RawText, cfg: TokenizerConfig, root: str) -> str:
    """A BPE tokenizer trained on the corpus's sample (`data.tokenizer.train_bytes`): the same
    sample gives the same tokenizer, so a corpus that grows outside it keeps its tokens."""
    key = _sample_key(raw, cfg, root)
    url = layout.folder(root, layout.TOKENIZERS, key)
    if not storage.is_complete(url):
        sample = _sample(manifest_files(raw), cfg.train_bytes)
        tok = text.BpeTokenizer.train(_sample_chunks(sample, cfg.strip_gutenberg), cfg.bpe_vocab_size, cfg.normalize)
        with storage.staged_dir(url) as out:
            storage.write_text(storage.join(out, "tokenizer.json"), tok.to_json())
        get_run_logger().info(
            "BPE tokenizer trained on %d files, %d bytes (sample %s)", len(sample), sum(n for _, n in sample), key
        )
    return storage.join(url, "tokenizer.json")


def _pack_key(pack: PackSpec, tokenizer: str, cfg: TokenizerConfig, span_bytes: int) -> str:
    return pack.key


@task(
    name="tokenize-pack",
    on_failure=[forget_exception],
    cache_key_fn=stage_cache(_pack_key),
    retries=1,
    retry_condition_fn=retry_unless_mistake,
)
def tokenize_pack(pack: PackSpec, tokenizer: str, cfg: TokenizerConfig, span_bytes: int) -> dict[str, Any]:
    """Tokenize the files of one pack; a pack already in storage is read, not made again."""
    if storage.is_complete(pack.url):
        return storage.read_json(storage.join(pack.url, "manifest.json"))
    tok = text.tokenizer_from_json(storage.read_text(tokenizer), source=tokenizer)
    with storage.staged_dir(pack.url) as out:
        packed = packs.tokenize_pack(pack.files, tok, out, cfg.strip_gutenberg, span_bytes)
        result = {
            "key": pack.key,
            "url": pack.url,
            "files": {
                p.sha256: {
                    "rows": p.rows,
                    "tokens": p.tokens,
                    "documents": p.documents,
                    "chars": p.chars,
                    "lost": p.lost,
                }
                for p in packed
            },
        }
        storage.write_json(storage.join(out, "manifest.json"), result)
    n = sum(p.tokens for p in packed)
    assets.materializes(pack.url, reads=[u for _, u in pack.files][:50], name="token pack")
    get_run_logger().info("tokenized %d files into pack %s: %d tokens", len(packed), pack.key, n)
    return result


def _existing_packs(folder: str) -> dict[str, dict[str, Any]]:
    """The packs a tokenizer has written under `folder`, by the files in them."""
    fs, path = storage.filesystem(folder)
    fs.invalidate_cache(path)
    found: dict[str, dict[str, Any]] = {}
    if not fs.exists(path):
        return found
    for entry in sorted(fs.ls(path, detail=False)):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        url = storage.join(folder, name)
        if name.startswith("pack-") and storage.is_complete(url):
            manifest = storage.read_json(storage.join(url, "manifest.json"))
            for sha in manifest["files"]:
                found.setdefault(sha, manifest)
    return found


def _corpus_tokens_key(raw: RawText, cfg: TokenizerConfig, span_bytes: int, tokenizer: str) -> str:
    what = cfg.model_dump(exclude={"train_bytes"})
    return storage.digest(
        ["corpus-tokens", what, span_bytes, tokenizer, layout.code_digest(files, packs, text, corpus, gutenberg)]
    )


def tokenize_source(raw: RawText, d: DataConfig, root: str) -> Tokens:
    """The tokenize stage: one text file as it always was; a corpus file by file, each file's
    tokens made once per tokenizer and reused by every corpus that holds it."""
    if raw.manifest is None:
        return tokenize(raw, d.tokenizer, root)
    cfg = d.tokenizer
    records = manifest_files(raw)
    if cfg.kind == "bpe":
        tokenizer = train_tokenizer(raw, cfg, root)
        tok_id = tokenizer.rsplit("/", 2)[-2]
    else:
        tokenizer, tok_id = "", cfg.kind
    key = _corpus_tokens_key(raw, cfg, d.split.span_bytes, tok_id)
    folder = layout.folder(root, layout.TOKENS, key)
    if not tokenizer:
        tokenizer = storage.join(folder, "tokenizer.json")
        if not storage.exists(tokenizer):
            storage.write_text(tokenizer, text.build_tokenizer(cfg).to_json())
    existing = _existing_packs(folder)
    reused = {r.key: existing[r.key] for r in records if r.key in existing}
    new = [r for r in records if r.key not in existing]
    by_sha = {r.key: r for r in records}
    specs = {m["key"]: PackSpec(key=m["key"], url=m["url"], files=[]) for m in reused.values()}
    for shas in packs.group([(r.key, r.bytes) for r in new], PACK_BYTES):
        k = packs.pack_key(key, shas)
        specs[k] = PackSpec(key=k, url=storage.join(folder, f"pack-{k}"), files=[(s, by_sha[s].url) for s in shas])
    logger = get_run_logger()
    logger.info(
        "tokenize: %d new files into %d packs; %d files reused from %d packs",
        len(new),
        len(specs) - len({m["key"] for m in reused.values()}),
        len(reused),
        len({m["key"] for m in reused.values()}),
    )
    ordered = [specs[k] for k in sorted(specs)]
    made = fan_out(
        tokenize_pack,
        ordered,
        sum(by_sha[s].bytes for s, _ in (f for p in ordered for f in p.files)),
        d.task_runner,
        tokenizer,
        cfg,
        d.split.span_bytes,
    )
    wanted = set(by_sha)
    used = []
    n_tokens = n_rows = 0
    loss = Loss()
    for m in made:
        mine = sorted(set(m["files"]) & wanted)
        used.append({"url": m["url"], "files": None if len(mine) == len(m["files"]) else mine})
        n_tokens += sum(m["files"][s]["tokens"] for s in mine)
        n_rows += sum(m["files"][s]["rows"] for s in mine)
        for s in mine:
            loss.add(m["files"][s])
    if n_tokens == 0:
        raise UserError(
            f"no tokens left in {raw.source} after the {cfg.kind} tokenizer's normalisation: is it "
            "the text you meant? (data.tokenizer.normalize=false keeps every character)"
        )
    corpus_url = storage.join(folder, f"corpus-{raw.sha256[:16]}.json")
    if not storage.exists(corpus_url):
        storage.write_json(
            corpus_url, {"corpus": raw.sha256, "packs": used, "files": len(records), "n_tokens": n_tokens}
        )
    assets.materializes(corpus_url, reads=[raw.url], name="token chunks")
    assets.describe(corpus_url, tokenizer=cfg.kind, n_tokens=n_tokens, files=len(records), packs=len(used))
    return Tokens(
        key=storage.digest([key, raw.sha256]),
        url=folder,
        corpus=corpus_url,
        tokenizer=tokenizer,
        n_tokens=n_tokens,
        n_chunks=n_rows,
        raw_sha256=raw.sha256,
        files_tokenized=len(new),
        files_reused=len(reused),
        **loss.fields(),
    )


class Loss:
    """The normalisation losses of a corpus's files, summed; unknown when one file's is."""

    def __init__(self) -> None:
        self.chars: int | None = 0
        self.lost: Counter[str] = Counter()

    def add(self, facts: dict[str, Any]) -> None:
        if self.chars is None or facts.get("chars") is None or facts.get("lost") is None:
            self.chars = None
            return
        self.chars += facts["chars"]
        self.lost.update(facts["lost"])

    def fields(self) -> dict[str, Any]:
        return {"chars": self.chars, "lost": dict(self.lost)} if self.chars else {}


# A corpus that loses more of its characters than this to the tokenizer says so.
DROPPED_WARN = 0.02


# What lost_by_kind calls the newlines and spaces that normalisation folds away.
WHITESPACE = "runs of whitespace"


def lost_by_kind(tokens: Tokens) -> dict[str, int]:
    """The characters the tokenizer's normalisation lost, by kind, adding up to what it lost.

    The char tokenizer's counts (Tokenizer.take_loss) hold every newline read under '\\n' and the
    spaces its runs folded under ' ', but a newline between two words becomes a space and is not
    lost. The other kinds are exact (characters dropped outright, non-ASCII ones); the
    whitespace lost is what is left of the total (characters read less tokens made). Derived
    here rather than counted anew by the tokenizer, whose source is in every tokens key."""
    kinds = {k: n for k, n in (tokens.lost or {}).items() if k not in ("\n", " ")}
    if tokens.chars and (folded := tokens.chars - tokens.n_tokens - sum(kinds.values())) > 0:
        kinds[WHITESPACE] = folded
    return kinds


def dropped_line(tokens: Tokens) -> str | None:
    """One line for a corpus whose tokenizer's normalisation dropped more than DROPPED_WARN of its
    characters: the share and the characters dropped most."""
    share = tokens.dropped_share()
    if share is None or share <= DROPPED_WARN:
        return None
    top = sorted(lost_by_kind(tokens).items(), key=lambda kv: (-kv[1], kv[0]))[:6]
    shown = ", ".join(f"{c if len(c) > 1 else repr(c)} {n / tokens.chars:.1%}" for c, n in top)  # non-ASCII, ...
    return (
        f"the tokenizer's normalisation dropped {share:.1%} of the corpus's characters (most: {shown}): set "
        "data.tokenizer.normalize=false to keep every character, or choose a recipe made for such text"
    )


def corpus_packs(tokens: Tokens) -> tuple[packs.CorpusPacks, int]:
    """The packs a corpus's tokens are in (the tokens stage's `corpus-<digest>.json`), and its
    number of files."""
    doc = storage.read_json(tokens.corpus)
    return packs.CorpusPacks([(p["url"], p["files"]) for p in doc["packs"]]), doc["files"]
