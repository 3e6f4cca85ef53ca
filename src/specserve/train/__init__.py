"""EAGLE-3 head training: prompt sources, self-distillation, target features, the
training-time test and the training loop behind `specserve train-eagle3`."""
