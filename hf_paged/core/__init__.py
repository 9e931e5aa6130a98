"""Request state and scheduling: requests, the scheduler, the KV cache manager and block pool,
and the plain data that crosses to the runner and back (outputs.py)."""
