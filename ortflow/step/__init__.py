"""The pieces of a training step every engine consumes: the batch's structure, the loss, the optimizer settings and
the learning-rate schedule."""
