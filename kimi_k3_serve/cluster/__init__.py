"""The cluster as it is: declared cluster files, the live Ray inventory, NVML readings."""
