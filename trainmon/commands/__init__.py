"""Subcommands of the `trainmon` command line; each module registers one or more with `register(subparsers)`."""
