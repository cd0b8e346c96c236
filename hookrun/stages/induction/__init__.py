"""Induction scores (experiment=induction): each head's attention from a repeated token to
the one after its earlier copy."""
