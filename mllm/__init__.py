"""mllm: small language models in plain PyTorch.

Tokenizers, vocabulary, datasets, models (RNN, LSTM, GPT), training with resume, sampling and
evaluation. Runs on its own in any container: this package never imports prefect or mlflow.
"""

__version__ = "0.1.0"


class UserError(ValueError):
    """A mistake in the user's input: its message is one line that names the problem and the fix.

    Entry points print it without a traceback and exit with status 2.
    """
