"""The `sao` command line."""
