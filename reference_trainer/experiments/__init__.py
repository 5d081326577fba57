"""Experiments around the reference trainer, each a command: ``measure`` (predicted vs measured activation bytes of
one micro-batch), ``compare`` (every policy side by side under torchrun), ``calibrate`` (the simulator fitted to and
checked against the trainer) and ``chaos`` (faults injected over a grid of policies, seeds and layouts)."""
