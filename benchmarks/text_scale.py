"""Part 3 of benchmarks.data_stages: the data stages on War and Peace's body repeated to many MB, in
a worker process of their own, with each stage's time and peak memory (`Peaks`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO, prefect_env
from benchmarks.memory_peaks import Peaks

SCALE_KINDS = {"char": {"kind": "char"}, "word": {"kind": "word"}, "bpe 2000": {"kind": "bpe", "bpe_vocab_size": 2000}}


def write_big_text(body: str, path: Path, size_mb: int) -> tuple[int, str]:
    """War and Peace's body repeated to `size_mb` MB (no Gutenberg markers: nothing is cut)."""
    import hashlib

    block = (body.rstrip() + "\n\n").encode("utf-8")
    digest, n, size = hashlib.sha256(), 0, size_mb * 1_000_000
    with open(path, "wb") as f:
        while n < size:
            part = block if n + len(block) <= size else block[: block.rfind(b"\n", 0, size - n) + 1]
            f.write(part)
            digest.update(part)
            n += len(part)
            if not part:
                break
    return n, digest.hexdigest()


def worker(spec: dict) -> dict:
    """In a process of its own: the stages on one big text, with time and peak memory of each."""
    from prefect import flow

    from mllm.config import SplitConfig, TokenizerConfig, VocabConfig
    from tasks.data import RawText
    from tasks.data.split import split
    from tasks.data.tokenize import tokenize
    from tasks.data.vocabulary import build_vocabulary

    @flow(name="bench-scale")
    def scale(raw, root: str, kinds: list[str], more: bool) -> dict:
        out = {}
        for kind in kinds:
            cfg = TokenizerConfig(**SCALE_KINDS[kind])
            with Peaks() as p:
                tokens = tokenize(raw, cfg, f"{root}/{kind.replace(' ', '-')}")
            out[f"tokenize {kind}"] = p.report(tokens=tokens.n_tokens)
            if more and kind == "char":
                with Peaks() as p:
                    vocab = build_vocabulary(tokens, VocabConfig(), root)
                out["build-vocabulary"] = p.report()
                with Peaks() as p:
                    split(tokens, vocab, SplitConfig(), root)
                out["split"] = p.report()
        return out

    @flow(name="bench-warm-up")
    def warm_up() -> None:
        pass

    warm_up()  # Prefect's temporary server and client: started before the first measurement
    results = []
    for item in spec["texts"]:
        raw = RawText(source=item["path"], url=item["path"], sha256=item["sha256"], bytes=item["bytes"])
        out = scale(raw, item["root"], item["kinds"], item["more"])
        results.append({"mb": item["bytes"] / 1e6, **out})
    return {"results": results}


def scale_runs(body: str, tmp: Path, sizes: list[int], more_up_to: int, up_to: dict[str, int]) -> list[dict]:
    texts = []
    for mb in sizes:
        path = tmp / f"text-{mb}MB.txt"
        n, sha = write_big_text(body, path, mb)
        kinds = [k for k in SCALE_KINDS if mb <= up_to.get(k, mb)]
        texts.append(
            {
                "path": str(path),
                "bytes": n,
                "sha256": sha,
                "root": str(tmp / f"scale-{mb}"),
                "kinds": kinds,
                "more": mb <= more_up_to,
            }
        )
        os.sync()  # the text written, not still in flight, when the first stage's clock starts
    env = {**prefect_env(tmp / "scale-home"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.data_stages", "--worker", json.dumps({"texts": texts})],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=3600,
    )
    for t in texts:
        os.remove(t["path"])
    if out.returncode != 0:
        raise RuntimeError(f"scale worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    rows = []
    for r in results:
        for stage, st in r.items():
            if stage == "mb":
                continue
            rows.append(
                {
                    "stage": stage,
                    "text_mb": r["mb"],
                    "seconds": st["s"],
                    "mb_per_s": r["mb"] / st["s"],
                    "cpu_s": st["cpu_s"],
                    "mb_per_cpu_s": r["mb"] / st["cpu_s"],
                    "peak_rss_mb": st["peak"] / 1e6,
                    "peak_anon_mb": st["anon"] / 1e6,
                    "peak_file_mb": st["file"] / 1e6,
                    "start_rss_mb": st["start"] / 1e6,
                    "added_anon_mb": (st["anon"] - st["start_anon"]) / 1e6,
                    "tokens": st.get("tokens"),
                    "peak_tracked": st["peak_reset"],
                    "load": st["load"],
                }
            )
            print(
                f"  {stage} on {r['mb']:.0f} MB: {st['s']:.1f} s ({r['mb'] / st['s']:.1f} MB/s; "
                f"{st['cpu_s']:.1f} CPU s, {r['mb'] / st['cpu_s']:.1f} MB per CPU s), peak RSS "
                f"{st['peak'] / 1e6:,.0f} MB (anonymous {st['anon'] / 1e6:,.0f}, file-backed "
                f"{st['file'] / 1e6:,.0f}; {st['start'] / 1e6:,.0f} MB at the stage's start), "
                f"load {st['load']}",
                flush=True,
            )
    return rows


def peak_growth(rows: list[dict]) -> dict[str, dict]:
    """Per stage, how its peak memory grew from its smallest to its largest text, per MB of text.

    Anonymous memory is counted from the stage's own start: the worker runs every size in one
    process, and what an earlier stage left in the allocators' pools (Arrow's, glibc's) is not
    this stage's doing."""
    out = {}
    for stage in dict.fromkeys(r["stage"] for r in rows):
        rs = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["text_mb"])
        if len(rs) > 1:
            a, b = rs[0], rs[-1]
            per = lambda key: (b[key] - a[key]) / (b["text_mb"] - a["text_mb"])  # noqa: E731 (a one-line helper, named where it is used)
            out[stage] = {
                "text_from": a["text_mb"],
                "text_to": b["text_mb"],
                "anon_from_mb": a["added_anon_mb"],
                "anon_to_mb": b["added_anon_mb"],
                "anon_mb_per_text_mb": per("added_anon_mb"),
                "rss_mb_per_text_mb": per("peak_rss_mb"),
            }
    return out
