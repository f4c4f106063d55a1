"""Page-selection policies. Each file registers one policy by name."""
from .base import POLICIES, DecodeContext, PagePolicy, get_policy, register_policy
from . import full, h2o, oracle, query_aware, streaming  # noqa: F401  (registration)

__all__ = ["POLICIES", "DecodeContext", "PagePolicy", "get_policy", "register_policy"]
