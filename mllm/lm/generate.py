"""A language model's text: greedy, temperature, top-k, top-p and beam search, a token a step with a
carried state or KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mllm import UserError
from mllm.config import METHODS
from mllm.lm.decode import bf16_decoder, decode_precision
from mllm.runtime import speed

if TYPE_CHECKING:
    from mllm.runtime.checkpoint import Loaded

# Below this temperature softmax(logits / T) is one-hot up to float rounding: take the argmax
# rather than divide by (nearly) zero.
MIN_TEMPERATURE = 1e-5


def filter_top_k(logits, k: int):
    """Logits [B, V] with all but the k largest of each row set to -inf (exactly k kept, ties or not)."""
    values, indices = torch.topk(logits, min(k, logits.size(-1)), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def filter_top_p(logits, p: float):
    """Logits [B, V] keeping, per row, the smallest set of most likely tokens whose mass reaches p."""
    sorted_logits, indices = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach p; the first has 0 above it, so
    # at least one token always survives.
    above = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(above >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, sorted_logits)


def next_token(
    logits,
    method: str,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
):
    """Pick the next token [B, 1] from the last position's logits [B, V]."""
    if method == "greedy" or temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if method == "top-k":
        logits = filter_top_k(logits, top_k)
    elif method == "top-p":
        logits = filter_top_p(logits, top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


class _Context:
    """Feeds a growing sequence [B, t] to the model and returns the next token's logits [B, V]."""

    def __init__(self, model, use_cache: bool):
        self.model, self.use_cache = model, use_cache
        # A GPT's positions end at block_size; a recurrent model has no such limit.
        self.block = getattr(model.config, "block_size", None)
        self.state = None

    def __call__(self, seq, new: int):
        """`new`: how many of seq's last tokens the model has not seen yet."""
        if not self.use_cache:
            logits, _, _ = self.model(seq if self.block is None else seq[:, -self.block :])
            return logits[:, -1]
        if self.block is not None and (self.state is None or self.state.length + new > self.block):
            self.state = self.model.new_state(seq.size(0), seq.device)
            new = min(seq.size(1), self.block, max(new, self.block // 2))
        logits, _, self.state = self.model(seq[:, -new:], state=self.state)
        return logits[:, -1]

    def reorder(self, index):
        """Row i of the state becomes the old row index[i] (beam search)."""
        s = self.state
        if s is None:
            return
        if hasattr(s, "reorder"):
            s.reorder(index)
        elif isinstance(s, tuple):
            self.state = tuple(t[:, index] for t in s)  # (h, c) of an LSTM: [layers, B, H]
        else:
            self.state = s[:, index]


def _beam_search(ctx: _Context, seq, max_new_tokens: int, width: int, eos_id: int | None) -> list[int]:
    """Best continuation by the plain sum of token log-probs.

    Without eos every hypothesis has the same length, so length normalisation would change
    nothing; with eos, plain sums let the search stop exactly: a log-prob only falls as a
    hypothesis grows, so once a finished one beats every live beam nothing can overtake it.
    """
    start = seq.size(1)
    scores = torch.zeros(1, device=seq.device)
    finished: list[tuple[float, list[int]]] = []
    new = start
    for _ in range(max_new_tokens):
        logp = F.log_softmax(ctx(seq, new).float(), dim=-1)
        V = logp.size(-1)
        # With eos, twice the width: hypotheses that end leave the beam and must not empty it.
        n = min((2 if eos_id is not None else 1) * width, logp.numel())
        top, flat = (scores[:, None] + logp).view(-1).topk(n)
        parent, token = flat // V, flat % V
        if eos_id is not None:
            ended = token == eos_id
            finished += [(top[i].item(), seq[parent[i], start:].tolist()) for i in ended.nonzero()[:, 0]]
            alive = (~ended).nonzero()[:, 0][:width]
            if len(alive) == 0:
                break
            top, parent, token = top[alive], parent[alive], token[alive]
        scores = top
        seq = torch.cat([seq[parent], token[:, None]], dim=1)
        ctx.reorder(parent)
        new = 1
        if finished and max(f[0] for f in finished) >= scores[0].item():
            break
    best = (scores[0].item(), seq[0, start:].tolist()) if seq.size(1) > start else (float("-inf"), [])
    return max([best, *finished], key=lambda f: f[0])[1]


@torch.inference_mode()  # no_grad still counts tensor versions: per-op overhead that decoding feels
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    method: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    beam_width: int = 4,
    seed: int | None = None,
    use_cache: bool = True,
    eos_id: int | None = None,
    dtype: str = "auto",
) -> list[int]:
    """The new token ids after `prompt_ids` (stopping before `eos_id` if the model produces it).

    temperature applies to every sampling method (temperature, top-k, top-p); top-k and top-p
    filter after it. `seed` seeds a generator of its own, so the same seed gives the same tokens
    whatever else uses the global RNG. dtype: the weights' precision when a GPT decodes with
    its cache on a CPU (decode_precision); without the cache it always computes in float32.
    """
    V = model.config.vocab_size
    if method not in METHODS:
        raise UserError(f"unknown sampling method {method!r}: choose one of {', '.join(METHODS)}")
    if not prompt_ids:
        raise UserError("the prompt is empty: give at least one token to continue from")
    if bad := [i for i in prompt_ids if not 0 <= i < V]:
        raise UserError(f"prompt ids {bad[:5]} lie outside the vocabulary (size {V}): encode with the model's vocab")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens is {max_new_tokens}: give 0 or more")
    if temperature < 0:
        raise UserError(f"temperature is {temperature}: give a value >= 0 (0 picks the most likely token)")
    if method == "top-k" and (top_k is None or top_k < 1):
        raise UserError(f"top-k sampling needs top_k >= 1 (got {top_k}): e.g. top_k=40")
    if method == "top-p" and (top_p is None or not 0 < top_p <= 1):
        raise UserError(f"top-p sampling needs 0 < top_p <= 1 (got {top_p}): e.g. top_p=0.9")
    if method == "beam" and beam_width < 1:
        raise UserError(f"beam_width is {beam_width}: give 1 or more")
    if dtype not in speed.DTYPES and dtype != "auto":
        raise UserError(f"unknown decoding dtype {dtype!r}: choose auto, float32 or bfloat16")
    device = next(model.parameters()).device
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()  # dropout off, or the same seed would not give the same text
    threads = torch.get_num_threads()
    # A cached step on the CPU is a few hundred ops on one token each, too small to share out:
    # every op that forks and joins the thread pool waits for its slowest thread, and on a shared
    # machine that one is often descheduled. Measured (benchmarks/vs_nanogpt.py), two threads were
    # at best even with one and under load many times slower, so the cached path takes one.
    one_thread = use_cache and device.type == "cpu" and threads > 1
    if one_thread:
        torch.set_num_threads(1)
    try:
        decoder = model
        if use_cache and decode_precision(model, dtype, device).dtype == "bfloat16":
            decoder = bf16_decoder(model)
        ctx = _Context(decoder, use_cache)
        if method == "beam":
            return _beam_search(ctx, seq, max_new_tokens, beam_width, eos_id) if max_new_tokens else []
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        out, new = [], seq.size(1)
        for _ in range(max_new_tokens):
            token = next_token(ctx(seq, new), method, temperature, top_k, top_p, generator)
            token_id = token.item()
            if token_id == eos_id:
                break
            seq, new = torch.cat([seq, token], dim=1), 1
            out.append(token_id)
        return out
    finally:
        model.train(was_training)
        if one_thread:
            torch.set_num_threads(threads)


def sample_text(loaded: "Loaded", prompt: str, method: str, **kw) -> str:
    """The prompt and its continuation as text; keyword arguments go to `generate`."""
    tokens = loaded.tokenizer.split(prompt)
    if prompt.strip() and not tokens:
        raise UserError(
            f"the prompt {prompt!r} is empty once normalised as the model's corpus was (it holds only "
            "characters that normalisation drops): give text the corpus could have held"
        )
    if missing := loaded.vocab.missing(tokens):
        raise UserError(not_in_vocabulary(loaded.config.data, missing, loaded.tokenizer.normalize))
    ids = loaded.vocab.encode(tokens)
    stoi = loaded.vocab.stoi
    if not ids and "<bos>" in stoi:
        ids = [stoi["<bos>"]]  # an empty prompt starts where every training document did
    kw.setdefault("max_new_tokens", loaded.config.sample.max_new_tokens)
    kw.setdefault("eos_id", stoi.get("<eos>"))
    kw.setdefault("dtype", loaded.config.sample.dtype)
    new = generate(loaded.model, ids, method=method, **kw)
    return loaded.tokenizer.detokenize(tokens + loaded.vocab.decode(new))


def not_in_vocabulary(data: Any, missing: list[str], normalized: bool) -> str:
    """The one line naming the tokens of a prompt that the model's vocabulary lacks, and why: its
    corpus (tokenized and normalised as the prompt was) did not have them, or too rarely."""
    what = {"char": "characters", "word": "words", "basic_english": "words"}.get(data.tokenizer.kind, "tokens")
    shown = " ".join(repr(t) for t in missing[:20]) + (" ..." if len(missing) > 20 else "")
    how = "normalised as the prompt was, " if normalized else ""
    rare = data.vocab.min_freq > 1 or data.vocab.max_size is not None
    why = (
        f"too rarely (data.vocab.min_freq {data.vocab.min_freq}, max_size {data.vocab.max_size}) or not at all"
        if rare
        else "none of them"
    )
    return (
        f"the prompt has {what} that are not in the model's vocabulary: {shown} (its training corpus, "
        f"{how}had {why}); leave them out of the prompt"
    )


OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "beam_width", "seed")


def with_defaults(loaded: "Loaded", **given) -> dict:
    """Sampling options: those given (None: not given), else the checkpoint's own `sample`
    section, so that a command repeats the run's own samples unless told otherwise."""
    s = loaded.config.sample
    return {**{k: getattr(s, k) for k in OPTIONS}, **{k: v for k, v in given.items() if v is not None}}


def fit_prompt(loaded: "Loaded", prompt: str) -> tuple[str, list[str]]:
    """A recipe's own prompt with the tokens the vocabulary lacks left out, and those tokens:
    a corpus without a "P" still gets samples from a recipe that prompts "Prince Andrew "."""
    tokens = loaded.tokenizer.split(prompt)
    missing = loaded.vocab.missing(tokens)
    if not missing:
        return prompt, []
    kept = [t for t in tokens if t not in set(missing)]
    return loaded.tokenizer.detokenize(kept), missing
