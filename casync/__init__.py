"""CaSync: compression-aware gradient synchronization (primitives, graphs, executor)."""

__all__: list[str] = []
