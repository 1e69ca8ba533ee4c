"""Names of the router's worker-choice policies, for ``pdcluster up --router-policy``.

Imports nothing, so the CLI offers the names without loading the router;
:data:`router.placement.POLICIES` maps each name to its class.

* ``cache_aware``: prefill workers by least expected prefill work (uncached prompt
  tokens + prompt tokens queued on the worker), decode and colocated workers as
  ``least_loaded``.
* ``least_loaded``: fewest requests in flight (router's count + worker's queue).
* ``round_robin``: each worker in turn.
"""

CACHE_AWARE = "cache_aware"
LEAST_LOADED = "least_loaded"
ROUND_ROBIN = "round_robin"
POLICY_NAMES = (CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN)
DEFAULT_POLICY = CACHE_AWARE


def check_policy(name: str) -> None:
    """Raises ValueError: ``name`` is not a registered policy (the message lists them)."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown router policy {name!r}; registered: {', '.join(POLICY_NAMES)}")
