"""The `stallfree data` commands: check a dataset (check), pack it into tar shards (pack), draw
the demo dataset (demo)."""
