"""The data stages on a corpus of many files: throughput, CPU time and peak memory on 1 and 2
processes, and the cost of adding one file. Run through `python -m benchmarks.data_stages
--many-files [--mb 1000] [--files 2000]` (or this module directly).

The corpus is made from the shared books (War and Peace and tiny shakespeare, bodies only):
each file is a slice of their text of a random length around the mean size, its paragraphs
shuffled with the file's own seed, so no two files are alike and none is a copy of a book.
Each configuration runs `prepare`'s stages (list + download, tokenize, vocabulary, split) in a
fresh subprocess with its own PREFECT_HOME and storage folder; one process is `taskset -c 0` (the
pool then has one worker), two is the machine's two cores. Figures per configuration: wall time
and MB of source per second of the download+tokenize stages and of all four, CPU seconds of
the process tree, the largest RSS of any one process (getrusage's ru_maxrss of the children)
its anonymous RSS (heap; sampled from /proc, without the page cache of memory-mapped files that
ru_maxrss counts and the kernel reclaims at will), and the anonymous RSS of the whole tree. Then one new file is added and the stages run again.
"""

from __future__ import annotations

import json
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import DATA, REPO, header, save, table

KINDS = {"char": [], "bpe 2000": ["data.tokenizer.kind=bpe", "data.tokenizer.bpe_vocab_size=2000"]}


def make_corpus(folder: Path, total_mb: int, n_files: int, seed: int = 0) -> int:
    """Write `n_files` varied text files of about `total_mb` MB in all; returns their bytes."""
    from mllm.data.gutenberg import strip_gutenberg

    body = "".join(strip_gutenberg([(DATA / "warandpeace.txt").read_text(encoding="utf-8")]))
    body += "\n\n" + (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in re.split(r"\n\s*\n", body) if p.strip()]
    rng = random.Random(seed)
    mean = total_mb * 1_000_000 // n_files
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for i in range(n_files):
        want = int(mean * rng.uniform(0.5, 1.5))
        start = rng.randrange(len(paragraphs))
        parts, size = [f"File {i} of the benchmark corpus."], 0
        while size < want:
            p = paragraphs[(start + len(parts)) % len(paragraphs)]
            parts.append(p)
            size += len(p) + 2
        head, tail = parts[:1], parts[1:]
        random.Random(seed * 100_003 + i).shuffle(tail)
        data = "\n\n".join(head + tail).encode("utf-8")
        (folder / f"part-{i:05d}.txt").write_bytes(data)
        written += len(data)
    return written


_STAGES = r"""
import json, os, sys, time
from prefect import flow
from mllm.resolve import resolve
from flows.launch import data_runner, with_results
from tasks.data.download import download_source
from tasks.data.split import split_source
from tasks.data.tokenize import tokenize_source, train_tokenizer
from tasks.data.vocabulary import build_vocabulary

source, root, sets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = resolve("default", overrides=sets, source=source)
times = {}

@flow(name="bench-prepare")
def stages():
    d = cfg.data
    t = time.perf_counter()
    raw = download_source(d, root)
    times["download"] = time.perf_counter() - t
    if d.tokenizer.kind == "bpe":  # trained here, then found cached by the tokenize stage
        t = time.perf_counter()
        train_tokenizer(raw, d.tokenizer, root)
        times["train tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    tokens = tokenize_source(raw, d, root)
    times["tokenize"] = time.perf_counter() - t
    t = time.perf_counter()
    vocab = build_vocabulary(tokens, d.vocab, root)
    times["vocabulary"] = time.perf_counter() - t
    t = time.perf_counter()
    split = split_source(tokens, vocab, d, root)
    times["split"] = time.perf_counter() - t
    return {"bytes": raw.bytes, "files": raw.files, "tokens": tokens.n_tokens, "tokenized": tokens.files_tokenized,
            "train": split.train.n_tokens, "val": split.val.n_tokens}

out = with_results(stages, root, data_runner(cfg.data.task_runner))()
print("RESULT " + json.dumps({**out, "times": times}))
"""


def _anon_rss(pid: int) -> tuple[int, int]:
    """(largest, sum) of the anonymous RSS (RssAnon: heap, not the page cache of memory-mapped
    files, which the kernel takes back at will) of `pid` and its descendants, in bytes."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    sizes = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                sizes += [int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")]
        except OSError:
            pass
    return max(sizes, default=0), sum(sizes)


def run_stages(source: Path, root: Path, home: Path, sets: list[str], cpus: str | None) -> dict:
    from benchmarks.common import prefect_env

    cmd = [sys.executable, "-c", _STAGES, str(source), str(root), json.dumps(sets)]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = [0, 0]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=prefect_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def sample() -> None:
        while proc.poll() is None:
            one, tree = _anon_rss(proc.pid)
            peak[0], peak[1] = max(peak[0], one), max(peak[1], tree)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"stages failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(line[len("RESULT ") :])
    result.update(
        wall_s=wall,
        cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        max_rss_one_mb=after.ru_maxrss / 1024,
        anon_one_mb=peak[0] / 1e6,
        anon_tree_mb=peak[1] / 1e6,
    )
    return result


def main(total_mb: int, n_files: int, kinds: list[str]) -> dict:
    m = header(f"data stages on {n_files} files, about {total_mb} MB", quick=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mllm-many-files-") as tmp:
        tmp_path = Path(tmp)
        t = time.perf_counter()
        size = make_corpus(tmp_path / "corpus", total_mb, n_files)
        print(f"corpus: {n_files} files, {size / 1e6:.0f} MB, written in {time.perf_counter() - t:.0f} s")
        for kind in kinds:
            for procs, cpus in ((1, "0"), (2, None)):
                root = tmp_path / f"storage-{kind.split()[0]}-{procs}"
                r = run_stages(
                    tmp_path / "corpus", root, tmp_path / f"home-{kind.split()[0]}-{procs}", KINDS[kind], cpus
                )
                rows.append(_row(kind, procs, "first run", size, r))
                print(rows[-1])
                if procs == 2:
                    extra = tmp_path / "corpus" / "part-new.txt"
                    make_corpus(tmp_path / "one", total_mb // n_files or 1, 1, seed=7)
                    shutil.move(str(tmp_path / "one" / "part-00000.txt"), extra)
                    r = run_stages(
                        tmp_path / "corpus", root, tmp_path / f"home-{kind.split()[0]}-{procs}", KINDS[kind], cpus
                    )
                    rows.append(_row(kind, procs, "one file added", size, r))
                    print(rows[-1])
                    extra.unlink()
                shutil.rmtree(root, ignore_errors=True)
    cols = [
        "tokenizer",
        "processes",
        "run",
        "files tokenized",
        "download+tokenize s",
        "MB/s",
        "tokenize MB/s",
        "train tokenizer s",
        "split s",
        "all stages s",
        "CPU s",
        "peak RSS one MB",
        "peak anon one MB",
        "peak anon all MB",
    ]
    print(table(rows, [(c, c) for c in cols]))
    result = {"machine": m, "rows": rows, "mb": total_mb, "files": n_files}
    save("many_files", result)
    return result


def _row(kind: str, procs: int, what: str, size: int, r: dict) -> dict:
    t = r["times"]
    dt = t["download"] + t.get("train tokenizer", 0) + t["tokenize"]
    return {
        "tokenizer": kind,
        "processes": procs,
        "run": what,
        "files tokenized": r["tokenized"],
        "download+tokenize s": round(dt, 1),
        "MB/s": round(size / 1e6 / dt, 1),
        "tokenize MB/s": round(size / 1e6 / t["tokenize"], 1),
        "split s": round(t["split"], 1),
        "train tokenizer s": round(t.get("train tokenizer", 0), 1),
        "all stages s": round(sum(t.values()), 1),
        "CPU s": round(r["cpu_s"], 1),
        "peak RSS one MB": round(r["max_rss_one_mb"]),
        "peak anon one MB": round(r["anon_one_mb"]),
        "peak anon all MB": round(r["anon_tree_mb"]),
        "wall s": round(r["wall_s"], 1),
        "times": {k: round(v, 2) for k, v in t.items()},
    }


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--kinds", default="char,bpe 2000")
    a = p.parse_args()
    main(a.mb, a.files, a.kinds.split(","))
