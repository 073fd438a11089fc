"""Process limits for pool children: what keeps one bad input from taking the host."""

from __future__ import annotations

import resource


def cap_address_space(megabytes: int) -> None:
    """Cap this process's virtual memory; allocations past it fail with MemoryError instead of paging the host."""
    limit = megabytes * 1024 * 1024
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
