"""Request ids that more than one process must agree on (torch-free: the server's API process
names a request's siblings before the engine process builds them)."""

from __future__ import annotations


def sibling_request_id(request_id: str, index: int) -> str:
    """The id of sample `index` of a request with n > 1 (index 0 keeps the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"
