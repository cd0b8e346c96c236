"""Models: where a model comes from (the model-source registry), the seeds' hand-set models,
and weights (torchvision names found offline, or state_dict files)."""
