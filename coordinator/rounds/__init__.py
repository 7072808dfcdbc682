"""The round loop: continuous batching, one draft call and one verify call per round, stop
conditions and streaming, failover; and the clients that reach the workers."""
