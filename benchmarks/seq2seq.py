"""Sequence to sequence on the numbers corpus: the RNN and the transformer recipe side by side.

    python -m benchmarks.seq2seq [--quick] [--threads N] [--minutes 10] [--recipes NAME ...]

Each recipe (benchmarks/recipes/seq2seq-numbers-*.yaml, there until the pipeline trains this
family) prepares its pairs with mllm.pairs, trains with the small loop below (`train_seq2seq`,
until the pipeline's training loop takes this family) for its
train.max_steps or --minutes of wall time, whichever ends first, then scores the held-out
numbers with mllm.translate: exact match, BLEU and chrF for greedy and beam 4, and decoding speed
in sentences/s. Held-out numbers never occur in training (the split keeps each source on one
side). It also draws one attention heatmap per recipe (`plot_attention`, the function tasks/ can
take for MLflow's picture artifact: matplotlib is not an mllm dependency).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import OUT, REPO, header, load, parse_args, save, table
from mllm.pairs import PairBatches, PairsConfig, load_side, load_split, prepare_pairs, read_pairs, vocab_sizes
from mllm.seq2seq import Seq2SeqConfig, build_seq2seq
from mllm.translate import evaluate, translate

RECIPES = ("seq2seq-numbers-rnn", "seq2seq-numbers-transformer")


def recipe(name: str) -> dict:
    return yaml.safe_load((REPO / "benchmarks" / "recipes" / f"{name}.yaml").read_text())


def lr_at(step: int, train: dict) -> float:
    """Linear warmup, then constant or cosine down to min_lr over max_steps (as mllm.train does)."""
    lr, warmup = train["lr"], train.get("warmup_steps", 0)
    if step < warmup:
        return lr * (step + 1) / warmup
    if train.get("lr_schedule", "constant") == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, train["max_steps"] - warmup))
    min_lr = train.get("min_lr", 0.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def train_seq2seq(model, batches: PairBatches, train: dict, max_seconds: float, log=print) -> dict:
    """Teacher-forced training for the benchmark: Adam(W), the recipe's schedule, gradient clipping."""
    opt_cls = torch.optim.AdamW if train.get("optimizer", "adam") == "adamw" else torch.optim.Adam
    opt = opt_cls(model.parameters(), lr=train["lr"], weight_decay=train.get("weight_decay", 0.0))
    model.train()
    t0, cpu0, step, loss = time.perf_counter(), time.process_time(), 0, float("nan")
    while step < train["max_steps"] and time.perf_counter() - t0 < max_seconds:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        _, loss_t, _ = model(*batches.next())
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        if train.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"])
        opt.step()
        step, loss = step + 1, loss_t.item()
        if step % 200 == 0:
            log(f"  step {step}: loss {loss:.4f}, epoch {batches.epoch:.2f}, {time.perf_counter() - t0:.0f} s")
    model.eval()
    return {"steps": step, "train_s": time.perf_counter() - t0, "train_cpu_s": time.process_time() - cpu0,
            "train_loss": loss, "epochs": batches.epoch}


def plot_attention(src_tokens: list[str], tgt_tokens: list[str], weights, path: str | Path, title: str = "") -> None:
    """A heatmap of attention weights [target, source] with the tokens on its axes, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.6 * len(src_tokens)), max(3.0, 1.5 + 0.4 * len(tgt_tokens))))
    ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=60, ha="right")
    ax.set_yticks(range(len(tgt_tokens)), tgt_tokens)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(name: str, args, folder: Path) -> dict:
    r = recipe(name)
    data, train = PairsConfig(**r["data"]), r["train"]
    if args.quick:
        data = data.model_copy(update={"numbers": data.numbers.model_copy(update={"count": 2000})})
    pairs, bad = read_pairs(data)
    model_cfg = Seq2SeqConfig(**r["model"])
    out = folder / name
    summary = prepare_pairs(pairs, data, str(out), model_cfg.max_src_len, model_cfg.max_tgt_len, bad)
    model_cfg = model_cfg.model_copy(update=vocab_sizes(str(out)))
    torch.manual_seed(train.get("seed", 1337))
    model = build_seq2seq(model_cfg)
    batches = PairBatches(load_split(str(out / "train.parquet")), train["batch_size"], train.get("seed", 1337))
    print(f"{name}: {model.num_params():,} parameters, {summary['train_pairs']} training pairs, "
          f"{summary['val_pairs']} held out", flush=True)
    row = {"recipe": name, "params": model.num_params(), "load_start": load(),
           **train_seq2seq(model, batches, train, args.minutes * 60)}
    val = load_split(str(out / "val.parquet"))
    src_tok, src_vocab = load_side(str(out), "src")
    tgt_tok, tgt_vocab = load_side(str(out), "tgt")
    for method, width in (("greedy", 1), ("beam", 4)):
        t0 = time.perf_counter()
        # A German number is one word: word BLEU has no 4-grams to count, so BLEU over characters.
        rep = evaluate(model, val, tgt_tok, tgt_vocab, method=method, beam_width=width, batch_size=256,
                       bleu_tokenize="char")
        seconds = time.perf_counter() - t0
        key = "greedy" if method == "greedy" else "beam4"
        # evaluate also scores the teacher-forced loss; its cost is small next to decoding
        row.update({f"{key}_exact": 100 * rep["exact_match"], f"{key}_bleu": rep["bleu"],
                    f"{key}_chrf": rep["chrf"], f"{key}_sents_per_s": rep["pairs"] / seconds})
        row["val_loss"], row["val_pairs"] = rep["loss"], rep["pairs"]
        row[f"{key}_table"] = rep["table"]
    example = r["sample"]["prompts"][0]
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
    print(table(rows, [("recipe", "recipe"), ("params", "params"), ("steps", "steps"), ("epochs", "epochs"),
                       ("train_s", "train s"), ("train_cpu_s", "train CPU s"), ("val_loss", "val loss"),
                       ("greedy_exact", "exact % greedy"), ("greedy_bleu", "char-BLEU greedy"),
                       ("greedy_chrf", "chrF greedy"), ("beam4_exact", "exact % beam4"),
                       ("beam4_bleu", "char-BLEU beam4"), ("beam4_chrf", "chrF beam4"),
                       ("greedy_sents_per_s", "sent/s greedy"), ("beam4_sents_per_s", "sent/s beam4"),
                       ("load_start", "load start"), ("load_end", "load end")]))
    for row in rows:
        print(f"\n{row['recipe']}: {row['example']} (attention: {row['attention_png']})")
        print(table(row["greedy_table"], [("source", "source"), ("reference", "reference"),
                                          ("hypothesis", "greedy hypothesis")]))
    save("seq2seq", {"machine": machine, "minutes": args.minutes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
