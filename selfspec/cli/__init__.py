"""Command-line interface: `selfspec <command>`, one module with a `main(argv)` per command."""
