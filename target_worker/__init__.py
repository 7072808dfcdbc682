"""The target worker: holds the target's paged KV cache, verifies draft tokens, truncates."""
