"""The public servers: gRPC Generate and the OpenAI-compatible HTTP API, their lifecycle and
health, admission limits, and how a request's bytes become a Request."""
