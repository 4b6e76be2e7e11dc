"""The model stages as Prefect tasks: train, evaluate, generate samples.

Training writes to `runs/<key>/` where the key digests the data it trains on, the model and
training config and the code. Running the same training again resumes from its last checkpoint
(and returns at once when that checkpoint is final): a crashed or killed run continues where it
stopped, and a finished one is not paid for twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from pydantic import BaseModel

import mllm.sample
import mllm.train
from mllm import UserError, cbow, checkpoint, evaluate as mllm_evaluate, gpt, models, rnn, seq2seq, storage
from mllm.config import CbowConfig, RunConfig, Seq2SeqConfig, TrainPaths
from mllm.data import load_ids
from mllm.sample import fit_prompt, sample_text, samples_text
from mllm.vocab import Vocab
import tasks
from tasks import embeddings, translation
from tasks.caching import code_digest, forget_exception, io_error, stage_cache, transient
from tasks.data import SourceSide, Splits, Tokens, Vocabulary
from tasks.provenance import code_git_info
from tasks.registry import ChampionScore
from tasks.tracking import RunTracker

class Prepared(BaseModel):
    """What the data stages hand on to training."""

    raw_sha256: str
    raw_url: str
    raw_bytes: int
    source: str
    tokens: Tokens
    vocab: Vocabulary
    splits: Splits
    source_side: SourceSide | None = None  # parallel text: the source side; vocab is the target's


class Trained(BaseModel):
    key: str
    run_dir: str
    config: str  # the job's config YAML: `python -m mllm.train --config` runs it again
    checkpoint: str
    best_checkpoint: str | None  # none until a validation has run
    steps: int
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    tokens_per_s: float
    elapsed_s: float
    stop_reason: str
    resumed_from_step: int

    def samples_url(self, method: str) -> str:
        return storage.join(self.run_dir, "samples", f"{method}.txt")


class Evaluation(BaseModel):
    split: str
    checkpoint: str
    loss: float  # held-out loss (nats per target)
    tokens: int  # targets scored
    report: str  # URL of the markdown report
    # The family's headline metric decides the champion (see mllm.config's HEADLINE).
    headline: str = "bits_per_byte"
    higher_is_better: bool = False
    metrics: dict[str, float] = {}  # every measure, the headline among them
    # Language models: comparable across tokenizers (bits per byte), and two baselines.
    perplexity: float | None = None
    bits_per_token: float | None = None
    bits_per_byte: float | None = None
    unigram_bits_per_token: float | None = None
    bigram_bits_per_token: float | None = None

    @property
    def score(self) -> float:
        return self.metrics[self.headline]


def train_key(cfg: RunConfig, data: Prepared) -> str:
    # The model section holds the chosen family's fields only: another family's cannot change it.
    return storage.digest(["train", data.splits.key, data.vocab.digest, cfg.model.model_dump(),
                           cfg.train.model_dump(), training_code()["digest"]])


def training_code() -> dict[str, str]:
    """The training code this process runs: the digest that goes into every training key, and
    its commit. A worker compares the caller's with its own before it trains."""
    return {"digest": code_digest(models, rnn, gpt, cbow, seq2seq, mllm.train), "commit": code_git_info()["commit"] or "unknown"}


def check_training_code(caller: dict[str, str]) -> None:
    """Refuse to train with other code than the caller's: the training key, the folder the model
    goes to and what the caller reads back would all differ."""
    ours = training_code()
    if caller["digest"] != ours["digest"]:
        raise UserError(f"the worker runs other training code than the pipeline that sent the job: pipeline "
                        f"at commit {caller['commit']}, worker at commit {ours['commit']} (code digests "
                        f"{caller['digest']} and {ours['digest']}): deploy the pipeline's commit to the worker "
                        "(rebuild its image or update its checkout), or run the pipeline from the worker's commit")


# A training job's progress line in a worker's log; `parse_progress` reads it back where the
# pipeline follows a job on a work pool, to drive its progress bar.
_PROGRESS = re.compile(r"^step (\d+)/(\d+|\?) loss ([0-9.naN]+)")


def progress_line(p: dict[str, Any]) -> str:
    loss = p.get("train_loss")
    return (f"step {p['step']}/{p['total_steps'] or '?'} loss {float('nan') if loss is None else loss:.4f} "
            f"lr {p.get('lr', 0.0):.2e} {p.get('tokens_per_s', 0.0):.0f} tok/s")


def parse_progress(line: str) -> dict[str, Any] | None:
    m = _PROGRESS.match(line)
    if m is None:
        return None
    loss = float(m.group(3))
    return {"step": int(m.group(1)), "total_steps": None if m.group(2) == "?" else int(m.group(2)),
            "train_loss": None if loss != loss else loss}


def train_job(cfg: RunConfig, data: Prepared, root: str) -> tuple[RunConfig, str]:
    """The config a training job runs: the run's tree with its input and output paths."""
    run_dir = storage.join(root, "runs", train_key(cfg, data))
    src = data.source_side
    paths = TrainPaths(train_ids=data.splits.train.ids, val_ids=data.splits.val.ids,
                       train_offsets=data.splits.train.offsets, val_offsets=data.splits.val.offsets,
                       vocab=data.vocab.url, tokenizer=data.tokens.tokenizer,
                       src_vocab=src.vocab.url if src else None, src_tokenizer=src.tokenizer if src else None,
                       checkpoint_dir=storage.join(run_dir, "checkpoints"))
    job = cfg.model_copy(update={"paths": paths}, deep=True)  # never change the caller's config
    if src:
        job.model.src_vocab_size, job.model.tgt_vocab_size = src.vocab.size, data.vocab.size
    else:
        job.model.vocab_size = data.vocab.size
    return job, run_dir


@task(name="train", on_failure=[forget_exception],
      retries=2, retry_delay_seconds=5, retry_condition_fn=io_error)
def train(cfg: RunConfig, data: Prepared, root: str, run_id: str | None = None) -> Trained:
    """Train (or resume) the run's model; metrics go to the MLflow run `run_id` in batches.

    A storage failure is retried (training resumes from its last checkpoint). The result is
    also written to `<run_dir>/trained.json`, where a pipeline that dispatched this training to
    a work pool reads it.
    """
    logger = get_run_logger()
    on_metrics = RunTracker.attach(run_id, cfg, root).metrics_after_resume() if run_id else None
    job, run_dir = train_job(cfg, data, root)
    config_url = storage.join(run_dir, "config.yaml")
    storage.write_text(config_url, job.to_yaml())
    logger.info("training %s %s: %s", cfg.recipe, cfg.model.arch, run_dir)
    every = float(os.environ.get("MLLM_LOG_EVERY_S", "10"))
    last_log = [0.0]

    def on_progress(p: dict[str, Any]) -> None:
        if tasks.progress_hook is not None:
            tasks.report_progress("train", p["step"], p["total_steps"], **p)
        elif time.monotonic() - last_log[0] > every:  # a line every few seconds in a worker's log
            last_log[0] = time.monotonic()
            logger.info(progress_line(p))

    if job.train.nproc_per_node > 1:
        result = _torchrun(job, on_metrics, on_progress)
    else:
        result = mllm.train.train(job, on_metrics=on_metrics, on_progress=on_progress)
    logger.info("trained %d steps (%s): val loss %s", result.steps, result.stop_reason,
                f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a")
    trained = Trained(key=train_key(cfg, data), run_dir=run_dir, config=config_url, **dataclasses.asdict(result))
    storage.write_json(storage.join(run_dir, "trained.json"), trained.model_dump(mode="json"))
    return trained


def _torchrun(job: RunConfig, on_metrics: Any, on_progress: Any) -> mllm.train.TrainResult:
    """Run `python -m mllm.train` under torchrun with `nproc_per_node` processes (DDP) and
    follow it through its event file: metrics to MLflow, progress to the log."""
    n = job.train.nproc_per_node
    logger = get_run_logger()
    with tempfile.TemporaryDirectory(prefix="mllm-torchrun-") as tmp:
        config, events, out = (os.path.join(tmp, name) for name in ("config.yaml", "events.jsonl", "out.log"))
        with open(config, "w") as f:
            f.write(job.to_yaml())
        open(events, "w").close()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "-m", "mllm.train", "--config", config, "--events", events]
        logger.info("starting %d training processes: torchrun --nproc_per_node=%d -m mllm.train", n, n)
        result: dict[str, Any] | None = None
        with open(out, "wb") as log, open(events, encoding="utf-8") as ev:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                pending = ""
                while True:
                    done = proc.poll() is not None
                    pending += ev.read()
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        event = json.loads(line)
                        if "metrics" in event and on_metrics:
                            on_metrics(event["metrics"])
                        elif "progress" in event:
                            on_progress(event["progress"])
                        elif "result" in event:
                            result = event["result"]
                    if done:
                        break
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:  # this task was cancelled or failed: stop the ranks
                    proc.terminate()
                    proc.wait(30)
        if proc.returncode != 0 or result is None:
            tail = open(out, errors="replace").read().strip().splitlines()
            errors = [line[len("error: "):] for line in tail if line.startswith("error: ")]
            if errors:
                raise UserError(errors[-1])
            raise RuntimeError(f"torchrun exited with status {proc.returncode}:\n" + "\n".join(tail[-20:]))
    return mllm.train.TrainResult(**result)


def _best(trained: Trained) -> str:
    best = trained.best_checkpoint
    return best if best and storage.exists(best) else trained.checkpoint


def _evaluate_key(cfg: RunConfig, trained: Trained, data: Prepared, split: str = "val") -> str:
    # The checkpoint is named by the training key and its step count (a longer resumed
    # training makes a new one); the split by its digest.
    return storage.digest(["evaluate", trained.key, trained.steps, data.splits.key, split,
                           cfg.train.window, cfg.sample.probes, code_digest(mllm_evaluate, embeddings, translation)])


def _generate_key(cfg: RunConfig, trained: Trained) -> str:
    return storage.digest(["generate", trained.key, trained.steps, cfg.sample.model_dump(),
                           code_digest(mllm.sample, embeddings, translation)])


@task(name="evaluate", on_failure=[forget_exception], cache_key_fn=stage_cache(_evaluate_key),
      retries=1, retry_condition_fn=transient)
def evaluate(cfg: RunConfig, trained: Trained, data: Prepared, split: str = "val") -> Evaluation:
    """Score the best checkpoint on a whole split, beside unigram and bigram baselines."""
    part = getattr(data.splits, split)
    if part is None:
        raise UserError(f"there is no {split} split: set data.split.test_fraction above 0 to make one")
    ckpt_url = _best(trained)
    loaded = checkpoint.load_checkpoint(ckpt_url)
    report_url = storage.join(trained.run_dir, f"eval-{split}.md")
    if isinstance(cfg.model, CbowConfig):
        return _evaluate_embeddings(cfg, trained, loaded, part, split, ckpt_url, report_url)
    if isinstance(cfg.model, Seq2SeqConfig):
        return _evaluate_translation(cfg, trained, loaded, part, split, ckpt_url, report_url)
    ids = load_ids(part.ids)
    scores = mllm_evaluate.evaluate(loaded.model, ids, window=cfg.train.window,
                                    batch_size=max(1, min(cfg.train.batch_size, 256)),
                                    n_bytes=part.n_bytes)
    train_ids = load_ids(data.splits.train.ids)
    unigram = mllm_evaluate.ngram_baseline(train_ids, ids, data.vocab.size, order=1)
    bigram = mllm_evaluate.ngram_baseline(train_ids, ids, data.vocab.size, order=2)
    result = Evaluation(split=split, checkpoint=ckpt_url, loss=scores["loss"],
                        perplexity=scores["perplexity"], bits_per_token=scores["bits_per_token"],
                        bits_per_byte=scores["bits_per_byte"], tokens=scores["tokens"],
                        unigram_bits_per_token=unigram["bits_per_token"],
                        bigram_bits_per_token=bigram["bits_per_token"], report=report_url,
                        metrics={k: scores[k] for k in ("loss", "perplexity", "bits_per_token", "bits_per_byte")})
    storage.write_text(report_url, evaluation_report(cfg, trained, result))
    storage.write_json(storage.join(trained.run_dir, f"eval-{split}.json"), result.model_dump(mode="json"))
    get_run_logger().info("%s: loss %.4f, %.3f bits/token, %.3f bits/byte (bigram baseline %.3f bits/token)",
                          split, result.loss, result.bits_per_token, result.bits_per_byte,
                          result.bigram_bits_per_token)
    return result


def _evaluate_embeddings(cfg: RunConfig, trained: Trained, loaded: Any, part: Any, split: str, ckpt_url: str,
                         report_url: str) -> Evaluation:
    result = embeddings.evaluate(loaded, part, cfg, storage.join(trained.run_dir, "embeddings"))
    headline, higher = type(cfg.model).HEADLINE
    evaluation = Evaluation(split=split, checkpoint=ckpt_url, loss=result["metrics"]["val_loss"],
                            tokens=result["n_samples"], report=report_url, headline=headline,
                            higher_is_better=higher, metrics=result["metrics"])
    storage.write_text(report_url, embeddings.report(cfg, ckpt_url, trained.steps, result))
    storage.write_json(storage.join(trained.run_dir, f"eval-{split}.json"), evaluation.model_dump(mode="json"))
    get_run_logger().info("%s: WordSim-353 Spearman %.4f (coverage %.2f), SimLex-999 %.4f, analogies %.4f, "
                          "held-out loss %.4f", split, result["metrics"]["wordsim353_spearman"],
                          result["metrics"]["wordsim353_coverage"], result["metrics"]["simlex999_spearman"],
                          result["metrics"]["analogy_accuracy"], evaluation.loss)
    for note in result["notes"]:
        get_run_logger().warning("%s", note)
    return evaluation


def _evaluate_translation(cfg: RunConfig, trained: Trained, loaded: Any, part: Any, split: str, ckpt_url: str,
                          report_url: str) -> Evaluation:
    result = translation.evaluate(loaded, part, cfg, storage.join(trained.run_dir, "attention"))
    headline, higher = type(cfg.model).HEADLINE
    m = result["metrics"]
    evaluation = Evaluation(split=split, checkpoint=ckpt_url, loss=m["val_loss"], tokens=result["n_targets"],
                            report=report_url, headline=headline, higher_is_better=higher, metrics=m)
    storage.write_text(report_url, translation.report(cfg, ckpt_url, trained.steps, result))
    storage.write_json(storage.join(trained.run_dir, f"eval-{split}.json"), evaluation.model_dump(mode="json"))
    get_run_logger().info("%s: %d pairs, exact match %.2f%%, BLEU %.2f, chrF %.2f, loss %.4f", split, result["pairs"],
                          100 * m["exact_match"], m["bleu"], m["chrf"], m["val_loss"])
    return evaluation


def _score_key(checkpoint_url: str, data: Prepared, window: int, split: str = "val") -> str:
    return storage.digest(["score", checkpoint_url, data.splits.key, split, window, code_digest(mllm_evaluate)])


@task(name="score-champion", on_failure=[forget_exception], cache_key_fn=stage_cache(_score_key),
      retries=1, retry_condition_fn=transient)
def score_checkpoint(checkpoint_url: str, data: Prepared, window: int, split: str = "val") -> ChampionScore:
    """Score another run's checkpoint (the champion's) on this run's split.

    The split's tokens are mapped into the checkpoint's own vocabulary (a token it never saw
    becomes <unk>), so a champion trained on other data is scored on exactly the same text. Bits
    per byte compare across vocabularies; loss only within one.
    """
    part = getattr(data.splits, split)
    loaded = checkpoint.load_checkpoint(checkpoint_url)
    ours = Vocab.load(data.vocab.url)
    ids = load_ids(part.ids)
    if loaded.vocab.itos != ours.itos:
        ids = loaded.vocab.encode_array(ours.itos)[np.asarray(ids, dtype=np.int64)]
    scores = mllm_evaluate.evaluate(loaded.model, ids, window=window, batch_size=64, n_bytes=part.n_bytes)
    get_run_logger().info("champion %s on this %s split: loss %.4f, %.4f bits/byte", checkpoint_url, split,
                          scores["loss"], scores["bits_per_byte"])
    return ChampionScore(checkpoint=checkpoint_url, split=split, splits_key=data.splits.key, loss=scores["loss"],
                 bits_per_byte=scores["bits_per_byte"], tokens=scores["tokens"])


def _translate_prompts(cfg: RunConfig, trained: Trained, loaded: Any) -> dict[str, list[str]]:
    """A seq2seq model's samples: "prompt -> translation" for the recipe's prompts and each
    method; a prompt with words the source vocabulary lacks is left out with a warning."""
    logger = get_run_logger()
    prompts, left_out = translation.usable_prompts(loaded, cfg.sample.prompts)
    for prompt, missing in left_out.items():
        logger.warning("sample prompt %r: the source vocabulary lacks %s; left out", prompt,
                       " ".join(repr(t) for t in missing[:20]) or "every token")
    samples: dict[str, list[str]] = {}
    for method in cfg.sample.methods:
        out = translation.translations(loaded, prompts, method, cfg.sample) if prompts else []
        samples[method] = [f"{p} -> {t}" for p, t in zip(prompts, out)]
        storage.write_text(trained.samples_url(method), samples_text(prompts, samples[method]))
    if prompts:
        logger.info("translations (%s): %s", cfg.sample.methods[0], samples[cfg.sample.methods[0]][0])
    return samples


def _translator_key(checkpoint_url: str, data: Prepared, bleu_tokenize: str, split: str = "val") -> str:
    return storage.digest(["score-translator", checkpoint_url, data.splits.key, split, bleu_tokenize,
                           code_digest(translation)])


@task(name="score-champion", on_failure=[forget_exception], cache_key_fn=stage_cache(_translator_key),
      retries=1, retry_condition_fn=transient)
def score_translator(checkpoint_url: str, data: Prepared, bleu_tokenize: str, split: str = "val") -> ChampionScore:
    """Score another run's seq2seq checkpoint (the champion's) on this run's held-out pairs: their
    texts go through the checkpoint's own tokenizers and vocabularies (an unknown word becomes
    <unk>), so a champion trained on other pairs or tokens translates exactly the same sentences."""
    part = getattr(data.splits, split)
    loaded = checkpoint.load_checkpoint(checkpoint_url)
    m = translation.score_texts(loaded, part, bleu_tokenize)
    get_run_logger().info("champion %s on this %s split: chrF %.4f, exact match %.4f", checkpoint_url, split,
                          m["chrf"], m["exact_match"])
    return ChampionScore(checkpoint=checkpoint_url, split=split, splits_key=data.splits.key, loss=m["val_loss"],
                         tokens=m["targets"], headline="chrf", value=m["chrf"])


def evaluation_report(cfg: RunConfig, trained: Trained, e: Evaluation) -> str:
    return "\n".join([
        f"# Evaluation of {cfg.recipe} on the {e.split} split",
        "",
        f"Checkpoint: `{e.checkpoint}` after {trained.steps} steps ({trained.stop_reason}).",
        "",
        "| metric | model | unigram | bigram |",
        "|---|---|---|---|",
        f"| loss (nats/token) | {e.loss:.4f} | | |",
        f"| perplexity | {e.perplexity:.3f} | | |",
        f"| bits per token | {e.bits_per_token:.4f} | {e.unigram_bits_per_token:.4f} | {e.bigram_bits_per_token:.4f} |",
        f"| bits per byte | {e.bits_per_byte:.4f} | | |",
        "",
        f"{e.tokens} tokens scored, each once.",
        "",
    ])


@task(name="generate", on_failure=[forget_exception], cache_key_fn=stage_cache(_generate_key),
      retries=1, retry_condition_fn=transient)
def generate(cfg: RunConfig, trained: Trained) -> dict[str, list[str]]:
    """One sample per prompt and sampling method, saved as `samples/<method>.txt`.

    The recipe's own prompts lose the tokens this corpus's vocabulary lacks (with a warning): a
    recipe written for one text still samples on another, and a model never goes unregistered
    because its sample prompt did not fit.
    """
    logger = get_run_logger()
    loaded = checkpoint.load_checkpoint(_best(trained))
    s = cfg.sample
    if isinstance(cfg.model, CbowConfig):
        known = [w for w in s.probes if w in embeddings.vectors(loaded)]
        for word in sorted(set(s.probes) - set(known)):
            logger.warning("probe word %r is not in the vocabulary: left out of the neighbours", word)
        table = embeddings.neighbours_of(loaded, known, s.neighbours)
        storage.write_text(trained.samples_url("neighbours"), samples_text(known, table))
        return {"neighbours": table}
    if isinstance(cfg.model, Seq2SeqConfig):
        return _translate_prompts(cfg, trained, loaded)
    prompts = []
    for prompt in s.prompts:
        fitted, missing = fit_prompt(loaded, prompt)
        if missing:
            logger.warning("sample prompt %r: the vocabulary lacks %s; sampling from %r instead", prompt,
                           " ".join(repr(t) for t in missing[:20]), fitted)
        prompts.append(fitted)
    samples: dict[str, list[str]] = {}
    for method in s.methods:
        samples[method] = [sample_text(loaded, prompt, method, max_new_tokens=s.max_new_tokens,
                                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                       beam_width=s.beam_width, seed=s.seed) for prompt in prompts]
        storage.write_text(trained.samples_url(method), samples_text(prompts, samples[method]))
    logger.info("samples (%s): %r", s.methods[0], samples[s.methods[0]][0][:120])
    return samples
