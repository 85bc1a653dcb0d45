"""The serving parts Ray Serve runs: the LLM server, the OpenAI ingress, health, streaming, the console."""
