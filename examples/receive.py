"""README "Receive replies": apply every reply of a principal once (runs until killed)."""

import threading
from broker_adapter import (Keyring, ReceiptStore, Receiver, ReceiverConfig, Reply, connect,
                            effect_key, open_database)

def effect(conn, reply: Reply) -> None:  # runs in the receipt's transaction: local writes only
    conn.execute("CREATE TABLE IF NOT EXISTS done (idem_key TEXT PRIMARY KEY, status TEXT)")
    conn.execute("INSERT INTO done VALUES (?, ?)", (effect_key(reply).idempotency_key, reply.status))

stop = threading.Event()
config = ReceiverConfig(principal="planner", consumer="planner-1")
Receiver(config, connect("redis://localhost:6390/0"), ReceiptStore(open_database("planner.db")),
         effect, keyring=Keyring.load("keyring.json")).run(stop)
