"""The numbers an intervention needs (`metrics:`): each row's loss, answer log probability,
logit difference, and KL, for the hooked model and the same rows without the hooks."""

from hookrun.stages.metrics import stage as stage  # registers the stage
