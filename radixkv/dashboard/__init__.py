"""The cache dashboard's data: the bounded, content-free tree snapshot (`snapshot`), the view an
engine core returns in one call (`cache_view`), and the history ring of samples (`history`)."""

from radixkv.dashboard.cache_view import cache_view
from radixkv.dashboard.history import History
from radixkv.dashboard.snapshot import tree_snapshot

__all__ = ["History", "cache_view", "tree_snapshot"]
