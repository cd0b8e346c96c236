"""Activation patching grids on language models (experiment=lm_patching): config.py parses
`patching:`, grid.py plans the grid and runs it per batch."""
