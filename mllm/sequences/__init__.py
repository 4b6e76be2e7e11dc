"""The sequence experiments (the seeds' parts IV and V): count on, or remember the first element
of, sequences of numbers, to show how far back a plain RNN carries what it read and an LSTM does.

Its modules: `data` (the sequences made from the config, their splits and batches) and `model`
(one-hot inputs, a recurrent layer, a read-out at every position). No corpus: the data stage
makes the sequences. Headline: accuracy of the prediction at every position on the validation
split (higher is better), which for the consecutive tasks is all of their sequences, as the seed
measured; a sample is the predicted next element of a prompt such as "7 8 9 10".
"""
