"""README "Publish without waiting": one signed request, without waiting for its reply."""

import time
from broker_adapter import Envelope, Keyring, Keys, Publisher, connect

publisher = Publisher(connect("redis://localhost:6390/0"), Keys(), "planner",
                      Keyring.load("keyring.json"))
envelope = Envelope.build(message_id="restart-web-1", sender="planner",
                          payload={"service": "web"}, deadline=time.time() + 300)
publisher.publish(envelope)  # RedisUnavailable means "maybe published": resend the SAME id
