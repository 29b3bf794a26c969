"""The adapter assembled: wiring of the stages, the worker pool, operator commands, the CLI."""
