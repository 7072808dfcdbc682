"""The coordinator: request queue, continuous batching, the round loop, stop conditions, streaming."""
