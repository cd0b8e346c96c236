"""Steering (experiment=steering): the vectors a run added, stored with where they came
from, and a sweep's jobs ranked by their effect against the fluency of what they wrote."""

from hookrun.stages.steering import stage as stage
