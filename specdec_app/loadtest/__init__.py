"""`specdec loadtest`: a bounded load test of the Generation service.

- records: the load asked for, each stream's prompt and cancel point, the checks and the report;
- streams: running the streams against a server's address (grpc.aio);
- embedded_server: a server of the test's own, so that the KV cache can be audited afterwards;
- chaos, replica_sweep (with local_ray): the runs on a local Ray deployment of their own;
- command: the subcommand's arguments and what it runs.

Nothing is imported here: the subcommand is specdec_app.loadtest.command, and the chaos and sweep
modules (which import Ray) load only when their runs are asked for.
"""
