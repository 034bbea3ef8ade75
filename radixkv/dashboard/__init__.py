"""The cache dashboard: the bounded, content-free tree snapshot (`snapshot`), the view an engine
core captures between steps and its caller finishes (`cache_view`), the history ring of samples
(`history`), the server's cache of answers (`snapshot_cache`), and the pages: the live one and the
offline reports, one self-contained HTML file each (`page`, over `static/`)."""

from radixkv.dashboard.cache_view import capture_view, finish_view
from radixkv.dashboard.history import History
from radixkv.dashboard.snapshot import tree_snapshot

__all__ = ["History", "capture_view", "finish_view", "tree_snapshot"]
