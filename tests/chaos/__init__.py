"""Jepsen-style chaos acceptance for broker_adapter.

A run starts its own redis-server, real adapter and receiver subprocesses, a loopback TCP
proxy, 2-4 publishing agents and a nemesis; it heals everything, drains, and checks the
rules of docs/RULES.md from final reads (SQLite tables, Redis streams and pending
lists), never from logs. See ``run.py`` for the command line.
"""
