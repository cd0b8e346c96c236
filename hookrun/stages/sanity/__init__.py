"""The sanity check by model randomisation (experiment=sanity_check)."""
