"""Training sparse dictionaries (SAEs and transcoders): experiment=train_sae.

`config.py` types the `sae:` node; `dictionary.py` is one dictionary's math and optimiser
(equal to SAELens's trainer); `sources.py` gives the activations, streamed from the model
through hooks or read from an earlier run's file; `job.py` runs the steps, checkpoints and
resumes them, and saves each dictionary in SAELens's format.
"""
