"""The sequence experiments' network, as the seed builds it: the one-hot input of each number into
a recurrent layer (torch's RNN, LSTM or GRU, or the cells written out in mllm.lm.rnn), and a
linear read-out of every position's hidden state into a score per number."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from mllm.config import SequenceModelConfig
from mllm.lm.rnn import LSTM, RNN


class SequenceRNN(nn.Module):
    def __init__(self, config: SequenceModelConfig):
        super().__init__()
        self.config = config
        kinds = {"lstm": LSTM, "rnn": RNN} if config.from_scratch else {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
        self.rnn = kinds[config.arch](config.vocab_size, config.hidden_size, config.n_layer, batch_first=True)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x, targets=None, state=None):
        h, state = self.rnn(F.one_hot(x, self.config.vocab_size).float(), state)
        logits = self.head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss, state
