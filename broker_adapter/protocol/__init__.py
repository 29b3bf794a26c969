"""The wire formats: envelopes, their signatures, the Redis key layout, replies, dead letters.

Each format is built and parsed in one module here. Nothing in this package does I/O: it
imports neither redis nor sqlite3, so an agent's publisher, the adapter and the tests all
read the same definitions.
"""
