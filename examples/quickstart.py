"""README quick start: an agent asks another agent and awaits the answer."""

from broker_adapter import Client, Keyring

with Client("redis://localhost:6390/0", "planner", Keyring.load("keyring.json")) as client:
    reply = client.request(None, {"service": "web"}, key="restart-web-incident-42", timeout_s=60)
    print(reply.result)  # a failed, cancelled, expired... task raises RequestError with .reply
