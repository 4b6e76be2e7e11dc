"""The language-model family: a character-, word- or BPE-level LSTM, GRU, RNN or GPT that continues a text."""
