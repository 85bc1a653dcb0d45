"""The checks before a replica loads anything: at build time (placement and memory) and at replica start (on the placement group Serve reserved)."""
