"""Recurrent language models (LSTM, GRU, RNN), with the LSTM and RNN cells also written out from the
equations under torch.nn.LSTM/RNN's parameter names."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm.config import ModelConfig
from mllm.runtime.optim import optim_groups


def lstm_step(x_proj, h, c, w_hh, b_hh):
    """One LSTM step; `x_proj` is the input's projection x @ w_ih.T + b_ih, done for all steps at once."""
    gates = x_proj + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def rnn_step(x_proj, h, w_hh, b_hh):
    return torch.tanh(x_proj + F.linear(h, w_hh, b_hh))


class _Cell(nn.Module):
    """Parameters of one layer, named and initialised as torch.nn.LSTMCell / nn.RNNCell."""

    gates = 1

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        g = self.gates * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(g, input_size))
        self.weight_hh = nn.Parameter(torch.empty(g, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(g)) if bias else None
        self.bias_hh = nn.Parameter(torch.empty(g)) if bias else None
        bound = 1 / math.sqrt(hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)


class LSTMCell(_Cell):
    gates = 4

    def forward(self, x, state=None):
        if state is None:
            zeros = x.new_zeros(x.size(0), self.hidden_size)
            state = (zeros, zeros)
        return lstm_step(F.linear(x, self.weight_ih, self.bias_ih), *state, self.weight_hh, self.bias_hh)


class RNNCell(_Cell):
    def forward(self, x, h=None):
        if h is None:
            h = x.new_zeros(x.size(0), self.hidden_size)
        return rnn_step(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh)


class _Stack(nn.Module):
    """Layers of cells over a batch_first sequence, with dropout between layers as torch applies it.

    The parameters sit on this module under torch.nn.LSTM's flat names (the cells' tensors, renamed
    per layer) so that `load_state_dict(torch_lstm.state_dict())` just works.
    """

    cell = _Cell

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        assert batch_first, "only batch_first=True: every model here is [batch, time]"
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, dropout
        for k in range(num_layers):
            cell = self.cell(input_size if k == 0 else hidden_size, hidden_size, bias)
            for name, p in cell.named_parameters():
                self.register_parameter(f"{name}_l{k}", p)

    def layer(self, k: int):
        get = lambda name: getattr(self, f"{name}_l{k}", None)  # noqa: E731 (a one-line helper, named where it is used)
        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh")

    def _between(self, x, k):
        if k < self.num_layers - 1 and self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        return x


class LSTM(_Stack):
    """torch.nn.LSTM(batch_first=True) from the equations: state is (h, c), each [layers, B, H]."""

    cell = LSTMCell

    def forward(self, x, state=None):
        B, T, _ = x.shape
        if state is None:
            zeros = x.new_zeros(self.num_layers, B, self.hidden_size)
            state = (zeros, zeros)
        h0, c0 = state
        hs, cs = [], []
        for k in range(self.num_layers):
            w_ih, w_hh, b_ih, b_hh = self.layer(k)
            # The input side has no recurrence: one matmul for every time step.
            x_proj = F.linear(x, w_ih, b_ih)
            h, c = h0[k], c0[k]
            out = []
            for t in range(T):
                h, c = lstm_step(x_proj[:, t], h, c, w_hh, b_hh)
                out.append(h)
            x = self._between(torch.stack(out, dim=1), k)
            hs.append(h)
            cs.append(c)
        return x, (torch.stack(hs), torch.stack(cs))


class RNN(_Stack):
    """torch.nn.RNN(batch_first=True, nonlinearity="tanh") from the equations: state is [layers, B, H]."""

    cell = RNNCell

    def forward(self, x, h0=None):
        B, T, _ = x.shape
        if h0 is None:
            h0 = x.new_zeros(self.num_layers, B, self.hidden_size)
        hs = []
        for k in range(self.num_layers):
            w_ih, w_hh, b_ih, b_hh = self.layer(k)
            x_proj = F.linear(x, w_ih, b_ih)
            h, out = h0[k], []
            for t in range(T):
                h = rnn_step(x_proj[:, t], h, w_hh, b_hh)
                out.append(h)
            x = self._between(torch.stack(out, dim=1), k)
            hs.append(h)
        return x, torch.stack(hs)


class RecurrentLM(nn.Module):
    """Embedding -> stacked LSTM/GRU/RNN -> linear head; the hidden state is carried between calls."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.arch in ("lstm", "gru", "rnn") and config.vocab_size > 0
        self.config = config
        # torch warns about (and ignores) dropout on a single layer; ours would ignore it too.
        dropout = config.dropout if config.n_layer > 1 else 0.0
        if config.from_scratch:
            kind = {"lstm": LSTM, "rnn": RNN}[config.arch]
        else:
            kind = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[config.arch]
        self.embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.rnn = kind(config.n_embd, config.hidden_size, config.n_layer, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        # word_language_model's init: small uniform embedding and head, torch's default for the cells.
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.head.weight, -0.1, 0.1)
        nn.init.zeros_(self.head.bias)
        if config.tie_weights and config.n_embd == config.hidden_size:
            # Press & Wolf 2017: one matrix for reading and writing tokens; fewer parameters, lower loss.
            self.head.weight = self.embedding.weight

    def forward(self, idx, targets=None, state=None):
        x = self.drop(self.embedding(idx))
        x, state = self.rnn(x, state)
        logits = self.head(self.drop(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss, state

    def new_state(self, batch_size: int, device=None):
        zeros = torch.zeros(self.config.n_layer, batch_size, self.config.hidden_size, device=device)
        return (zeros, zeros.clone()) if self.config.arch == "lstm" else zeros

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def optim_groups(self, weight_decay: float) -> list[dict]:
        return optim_groups(self, weight_decay)
