"""Checkpoint I/O at the edge: listing a checkpoint (hub, folder, bucket), each node's disk, and the per-node prefetch."""
