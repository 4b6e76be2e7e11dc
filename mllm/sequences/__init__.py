"""The sequence experiments (the seeds' parts IV and V): count on, or remember the first element of,
sequences of numbers, to show how far back an RNN and an LSTM carry what they read."""
