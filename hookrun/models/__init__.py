"""Models: where a model comes from (the model-source registry), the seeds' hand-set models,
weights (torchvision names found offline, or state_dict files) and Hugging Face language
models behind the token sample interface (hf.py, language.py)."""
