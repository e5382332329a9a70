"""zengine's own checkpoint format: sharded, layout-free, crash-safe (see ``checkpoint/``)."""
