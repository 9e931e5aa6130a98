"""Request state and scheduling: requests, the scheduler, the KV cache manager and block pool.

Stop checks (stop_checker) still run in the scheduler; a later step moves them to output processing.
"""
