"""A run, orchestrated: prepare (every check before any work) → stream (the batches through
the hooked model and the run's stages, into the file) → finish (the torchrun join, the
stages' whole-run work, pictures, the summary); runner.py ties them together with the
devices and the signals. It loops over the run's stages and names none of them."""
