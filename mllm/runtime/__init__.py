"""Around the training loop: inputs and epoch order, checkpoints, speed and compiling, devices and
distributed training, optimiser groups."""
