"""The sequence-to-sequence family: an attention encoder-decoder that translates parallel text.

Its modules: `model` (Bahdanau's RNN encoder-decoder and the transformer), `pairs` (a TSV of
pairs or the offline numbers corpus, split and tokenized per side, batches), `translate` (greedy,
beam and sampled decoding; loss, exact match, BLEU and chrF), `evaluation` (a checkpoint's scores,
a table of translations, attention pictures). Headline: chrF on the held-out pairs (higher is
better); a sample is a translation.
"""
