"""Tools shipped with the package: tiny offline checkpoints, the demo."""
