"""Everything that talks to Redis: clients and error translation, Lua scripts, the group reader.

This is the only package that imports ``redis`` (an import-linter contract checks it). It
may use ``broker_adapter.protocol`` for the formats it writes; it never touches the store.
"""
