"""Samples from a checkpoint of any family: `answer`, the one entry point the CLI, `runs` and the
served model call, and `python -m mllm.sample`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mllm import UserError
from mllm.config import METHODS
from mllm.families.base import family_of
from mllm.runtime.checkpoint import load_checkpoint

OPTIONS = ("method", "max_new_tokens", "temperature", "top_k", "top_p", "beam_width", "seed", "neighbours", "use_cache")


# The options each method reads (the others it would ignore without a word).
TUNING = {
    "greedy": (),
    "temperature": ("temperature",),
    "top-k": ("top_k", "temperature"),
    "top-p": ("top_p", "temperature"),
    "beam": ("beam_width",),
}


def check_method_options(given: dict[str, Any]) -> None:
    """Refuse an option (--top-p, --top-k, --temperature, --beam-width) that the method asked
    for (`given["method"]`) does not read."""
    method = given.get("method")
    if method not in TUNING:
        return
    for name in [n for n in ("temperature", "top_k", "top_p", "beam_width") if given.get(n) is not None]:
        if name not in TUNING[method]:
            takers = [m for m, names in TUNING.items() if name in names]
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} does not apply to --method {method} (it tunes {' and '.join(takers)}): "
                f"drop it, or choose --method {takers[0]}"
            )


def answer(loaded: Any, prompts: list[str] | None = None, **options: Any) -> list[str]:
    """One answer per prompt (None: the run's own prompts) from a loaded checkpoint."""

    family = family_of(loaded)
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise UserError(f"unknown sample option {', '.join(unknown)}: the options are {', '.join(OPTIONS)}")
    method = options.get("method")
    given = [
        k
        for k in ("method", "temperature", "top_k", "top_p", "beam_width", "max_new_tokens")
        if options.get(k) is not None
    ]
    if not family.methods and given:  # a model with no sampling methods (CBOW: nearest neighbours)
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserError(
            f"{family.a_model} answers with nearest neighbours: {flags} do not apply (--neighbours sets how many)"
        )
    if method is not None and family.methods and method not in family.methods:
        raise UserError(f"{family.a_model} samples with {', '.join(family.methods)}, not {method!r}")
    return family.sample(loaded, prompts, {k: v for k, v in options.items() if v is not None})


def prompt_losses(loaded: Any, prompts: list[str] | None) -> list[str]:
    """A line for each prompt that loses characters to the normalisation its model's corpus had
    (a normalising char tokenizer keeps no accents, no ':'): what it loses and what is left."""
    tokenizer = getattr(loaded, "src_tokenizer", None) or loaded.tokenizer
    lines = []
    for prompt in prompts or []:
        if lost := tokenizer.dropped(prompt):
            shown = " ".join(repr(c) for c in lost[:20]) + (" ..." if len(lost) > 20 else "")
            left = tokenizer.detokenize(tokenizer.split(prompt))
            lines.append(
                f"the prompt {prompt!r} loses {shown} to the normalisation its model's corpus had "
                f"(the model reads {left!r})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mllm.sample",
        description="Sample from a trained checkpoint of any family: continue a prompt, "
        "list a word's neighbours, translate, or predict the next element.",
    )
    p.add_argument("--checkpoint", required=True, help="URL or path of a checkpoint (best.pt / last.pt)")
    p.add_argument(
        "--prompt",
        action="append",
        help="text to continue, words, a sentence or numbers (repeatable; default: the run's own prompts)",
    )
    p.add_argument("--method", choices=METHODS, help="default: the run's first sample method")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--beam-width", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--neighbours", type=int, help="word embeddings: neighbours per word")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (a GPU when there is one)")
    args = p.parse_args(argv)
    try:
        loaded = load_checkpoint(args.checkpoint, device=args.device)
        options = {k: getattr(args, k) for k in OPTIONS if k != "use_cache"}
        check_method_options(options)
        losses = prompt_losses(loaded, args.prompt)
        out = answer(loaded, args.prompt, use_cache=not args.no_cache, **options)
        for line in losses:  # said once the model took the prompt: a refused one gets its error alone
            print(f"warning: {line}", file=sys.stderr)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
