"""The run spec: the config schema and every check that can run before the first batch."""
