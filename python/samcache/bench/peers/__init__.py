"""Real peer engines, run on the same checkpoint and trace as samcache for the benchmark."""
