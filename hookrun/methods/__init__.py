"""Derived methods: results computed per batch from captured tensors (a registry)."""
