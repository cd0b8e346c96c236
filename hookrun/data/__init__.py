"""Data: the dataset kinds (a registry) and the loader that batches them in dataset order."""
