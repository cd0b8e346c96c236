"""Running at scale: seeds and provenance, torchrun shards, sweeps and Slurm requeues."""
