"""Sequence to sequence on the numbers corpus: the RNN and the transformer recipe side by side.

    python -m benchmarks.seq2seq [--quick] [--threads N] [--minutes 10] [--recipes NAME ...]

Each recipe (mllm/recipes/seq2seq-numbers-*.yaml) prepares its pairs with mllm.seq2seq.pairs and trains
with the pipeline's own loop (mllm.train) for its train.max_steps or --minutes of wall time,
whichever ends first, then scores its best checkpoint on the held-out numbers with
mllm.seq2seq.translate: exact match, BLEU and chrF for greedy and beam 4, and decoding speed in
sentences/s. Held-out numbers never occur in training (the split keeps each source on one side).
It also draws one attention heatmap per recipe, as the pipeline's evaluate stage does.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import OUT, REPO, header, load, parse_args, save, table
from mllm.config import TrainPaths
from mllm.resolve import resolve
from mllm.runtime.checkpoint import load_checkpoint
from mllm.seq2seq.evaluation import plot_attention
from mllm.seq2seq.pairs import load_split, prepare_pairs, read_pairs
from mllm.seq2seq.translate import evaluate, translate
from mllm.train import train

RECIPES = ("seq2seq-numbers-rnn", "seq2seq-numbers-transformer")


def score(model, val, tgt_tok, tgt_vocab, bleu_tokenize) -> dict:
    """Exact match, BLEU, chrF and sentences/s on the held-out pairs, greedy and beam 4."""
    row: dict = {}
    for method, width in (("greedy", 1), ("beam", 4)):
        t0 = time.perf_counter()
        rep = evaluate(
            model,
            val,
            tgt_tok,
            tgt_vocab,
            method=method,
            beam_width=width,
            batch_size=256,
            bleu_tokenize=bleu_tokenize,
        )
        seconds = time.perf_counter() - t0
        key = "greedy" if method == "greedy" else "beam4"
        # evaluate also scores the teacher-forced loss; its cost is small next to decoding
        row.update(
            {
                f"{key}_exact": 100 * rep["exact_match"],
                f"{key}_bleu": rep["bleu"],
                f"{key}_chrf": rep["chrf"],
                f"{key}_sents_per_s": rep["pairs"] / seconds,
            }
        )
        row["val_loss"], row["val_pairs"] = rep["loss"], rep["pairs"]
        row[f"{key}_table"] = rep["table"]
    return row


def run(name: str, args, folder: Path) -> dict:
    cfg = resolve(name)
    data = cfg.data
    if args.quick:
        data.pairs.numbers.count = 2000
    pairs, bad = read_pairs(data)
    out = folder / name
    m = cfg.model
    summary = prepare_pairs(pairs, data, str(out), m.max_src_len, m.max_tgt_len, bad)
    paths = TrainPaths(
        train_ids=str(out / "train.parquet"),
        val_ids=str(out / "val.parquet"),
        vocab=str(out / "tgt_vocab.json"),
        tokenizer=str(out / "tgt_tokenizer.json"),
        src_vocab=str(out / "src_vocab.json"),
        src_tokenizer=str(out / "src_tokenizer.json"),
        checkpoint_dir=str(out / "checkpoints"),
    )
    job = cfg.model_copy(
        update={
            "paths": paths,
            "train": cfg.train.model_copy(update={"max_minutes": args.minutes, "device": "cpu", "log_interval": 200}),
        }
    )
    print(f"{name}: {summary['train_pairs']} training pairs, {summary['val_pairs']} held out", flush=True)
    row = {"recipe": name, "load_start": load()}
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = train(
        job,
        resume=False,
        on_progress=lambda p: print(
            f"  step {p['step']}: loss {p['train_loss']:.4f}, epoch {p['epoch']:.2f}, {p['elapsed_s']:.0f} s",
            flush=True,
        ),
    )
    row.update(
        steps=result.steps,
        stop=result.stop_reason,
        train_s=time.perf_counter() - t0,
        train_cpu_s=time.process_time() - cpu0,
        train_loss=result.train_loss,
    )
    loaded = load_checkpoint(result.best_checkpoint or result.checkpoint)
    model, src_tok, src_vocab, tgt_tok, tgt_vocab = (
        loaded.model,
        loaded.src_tokenizer,
        loaded.src_vocab,
        loaded.tokenizer,
        loaded.vocab,
    )
    row["params"] = model.num_params()
    row.update(score(model, load_split(str(out / "val.parquet")), tgt_tok, tgt_vocab, data.pairs.bleu_tokenize))
    example = cfg.sample.prompts[0]
    [(src_tokens, tgt_tokens, text, weights)] = translate(model, [example], src_tok, src_vocab, tgt_tok, tgt_vocab)
    picture = OUT / f"seq2seq-attention-{name}.png"
    OUT.mkdir(parents=True, exist_ok=True)
    plot_attention(src_tokens, tgt_tokens, weights, picture, f"{name}\n{example}\n-> {text}")
    row["example"], row["attention_png"] = f"{example} -> {text}", str(picture.relative_to(REPO))
    row["load_end"] = load()
    return row


def main() -> int:
    def extra(p):
        p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training limit per recipe")
        p.add_argument("--recipes", nargs="+", default=list(RECIPES))
        p.add_argument("--folder", default=str(OUT / "seq2seq-data"), help="where the prepared pairs go")

    args = parse_args(__doc__.splitlines()[0], extra)
    machine = header("seq2seq: numbers, English words -> German words", args.quick)
    rows = [run(name, args, Path(args.folder)) for name in args.recipes]
    print()
    print(
        table(
            rows,
            [
                ("recipe", "recipe"),
                ("params", "params"),
                ("steps", "steps"),
                ("stop", "stop"),
                ("train_s", "train s"),
                ("train_cpu_s", "train CPU s"),
                ("val_loss", "val loss"),
                ("greedy_exact", "exact % greedy"),
                ("greedy_bleu", "char-BLEU greedy"),
                ("greedy_chrf", "chrF greedy"),
                ("beam4_exact", "exact % beam4"),
                ("beam4_bleu", "char-BLEU beam4"),
                ("beam4_chrf", "chrF beam4"),
                ("greedy_sents_per_s", "sent/s greedy"),
                ("beam4_sents_per_s", "sent/s beam4"),
                ("load_start", "load start"),
                ("load_end", "load end"),
            ],
        )
    )
    for row in rows:
        print(f"\n{row['recipe']}: {row['example']} (attention: {row['attention_png']})")
        print(
            table(
                row["greedy_table"],
                [("source", "source"), ("reference", "reference"), ("hypothesis", "greedy hypothesis")],
            )
        )
    save("seq2seq", {"machine": machine, "minutes": args.minutes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
