"""Target replicas behind one endpoint: the router, the scale policy, and the thread that runs
each replica's scheduler."""
