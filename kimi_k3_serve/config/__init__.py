"""The deploy config: the typed ``args`` schema, model sources, the Serve-file reader and Ray's schema, and the one adapter from ``ServeArgs`` to the planner's and vLLM's inputs."""
