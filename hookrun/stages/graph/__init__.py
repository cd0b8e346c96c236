"""The attribution graph job (experiment=attribution_graph): circuit-tracer's graphs of
features over per-layer transcoders, one per prompt."""

from hookrun.stages.graph import stage  # noqa: F401  (registers the stage)
