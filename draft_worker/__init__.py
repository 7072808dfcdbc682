"""The draft worker: proposes K tokens per sequence (and q for sampled requests)."""
