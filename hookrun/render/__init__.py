"""Pictures, drawn only from a finished captures.h5 (`python -m hookrun.render FILE`)."""
