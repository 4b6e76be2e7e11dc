"""The language-model family: a character-, word- or BPE-level LSTM, GRU, RNN or GPT that
continues a text.

Its modules: `rnn` and `gpt` (the models), `windows` (training batches: windows of a split's
ids), `evaluate` (a whole split scored once, with n-gram baselines), `generate` (greedy,
sampling and beam search with a carried state or KV cache). Headline: validation bits per byte
of the raw text, which compares across tokenizers (lower is better).
"""
